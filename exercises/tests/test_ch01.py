"""Graded tests for chapter 01 (``minserve grade ch01``). Each test's docstring is the hint a learner sees.

The ``exercise`` fixture is the learner's module (or the reference solutions); the grader supplies it and
the ``points`` marker. Expected values are worked out by hand in the comments, or checked against
``minserve.slo`` on generated requests.
"""

from __future__ import annotations

import math
import random

import pytest

from minserve import slo


def _request(arrival_s, token_times_s, finish_s=None, status="ok"):
    finish_s = token_times_s[-1] if finish_s is None and token_times_s else finish_s
    return {"arrival_s": arrival_s, "token_times_s": token_times_s, "finish_s": finish_s, "status": status}


@pytest.mark.points(1)
def test_ttft(exercise):
    """TTFT is the first token's time minus the arrival time."""
    assert exercise.ttft_s(10.0, [10.25, 10.5]) == pytest.approx(0.25)


@pytest.mark.points(1)
def test_ttft_without_tokens(exercise):
    """With no tokens there is no first token: return None, not 0 and not an IndexError."""
    assert exercise.ttft_s(10.0, []) is None


@pytest.mark.points(1)
def test_itl(exercise):
    """ITL is the list of gaps between consecutive tokens: n tokens give n − 1 gaps."""
    assert exercise.itl_s([1.0, 1.5, 1.75, 2.75]) == pytest.approx([0.5, 0.25, 1.0])
    assert exercise.itl_s([1.0]) == []


@pytest.mark.points(1)
def test_e2e(exercise):
    """E2E runs from arrival to finish (not to the first token)."""
    assert exercise.e2e_s(3.0, 5.5) == pytest.approx(2.5)


@pytest.mark.points(2)
def test_tpot_curriculum_example(exercise):
    """TPOT = (E2E − TTFT) / (n − 1): TTFT 80 ms, E2E 2200 ms, 220 tokens gives 9.68 ms, not 10 ms."""
    times = [0.080 + i * (2.120 / 219) for i in range(220)]  # first token at 80 ms, last at 2200 ms
    assert exercise.tpot_s(0.0, times, 2.200) * 1e3 == pytest.approx(9.68, abs=0.005)


@pytest.mark.points(2)
def test_tpot_counts_time_after_the_last_token(exercise):
    """TPOT uses E2E, so time between the last token and the finish counts (divide by n − 1, not n)."""
    # TTFT 1 s, E2E 4 s, 4 tokens: (4 − 1) / 3 = 1 s.
    assert exercise.tpot_s(0.0, [1.0, 1.5, 2.0, 3.0], 4.0) == pytest.approx(1.0)


@pytest.mark.points(2)
def test_tpot_one_token(exercise):
    """A one-token answer has no decode phase: TPOT is None (and must not divide by zero)."""
    assert exercise.tpot_s(0.0, [0.3], 0.3) is None
    assert exercise.tpot_s(0.0, [], 0.3) is None


@pytest.mark.points(2)
def test_percentile_interpolates(exercise):
    """Sort first, then interpolate at position q/100 × (n − 1): p50 of [4, 1, 3, 2] is 2.5, p0 the minimum."""
    assert exercise.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert exercise.percentile([4.0, 1.0, 3.0, 2.0], 0) == pytest.approx(1.0)
    assert exercise.percentile([4.0, 1.0, 3.0, 2.0], 100) == pytest.approx(4.0)
    assert exercise.percentile([7.0], 99) == pytest.approx(7.0)


@pytest.mark.points(2)
def test_percentile_matches_minserve(exercise):
    """Your percentile must agree with linear interpolation on any data (compare with numpy.percentile)."""
    rng = random.Random(1)
    for _ in range(50):
        values = [rng.expovariate(1.0) for _ in range(rng.randint(1, 40))]
        q = rng.choice([50, 90, 95, 99, rng.uniform(0, 100)])
        assert exercise.percentile(values, q) == pytest.approx(slo.percentile(values, q))


@pytest.mark.points(2)
def test_percentile_edge_cases(exercise):
    """An empty list has no percentile (math.nan); q outside [0, 100] is a ValueError; don't sort in place."""
    assert math.isnan(exercise.percentile([], 50))
    with pytest.raises(ValueError):
        exercise.percentile([1.0, 2.0], 101)
    values = [3.0, 1.0, 2.0]
    exercise.percentile(values, 50)
    assert values == [3.0, 1.0, 2.0]


@pytest.mark.points(2)
def test_meets_slo(exercise):
    """Good means ok status, TTFT ≤ target and TPOT ≤ target; a one-token answer cannot miss TPOT."""
    fast = _request(0.0, [0.1, 0.2, 0.3])
    slow_start = _request(0.0, [0.9, 1.0, 1.1])
    slow_decode = _request(0.0, [0.1, 0.6, 1.1])
    one_token = _request(0.0, [0.1])
    assert exercise.meets_slo(fast, 0.5, 0.2)
    assert not exercise.meets_slo(slow_start, 0.5, 0.2)
    assert not exercise.meets_slo(slow_decode, 0.5, 0.2)
    assert exercise.meets_slo(one_token, 0.5, 0.2)


@pytest.mark.points(2)
def test_failed_and_cancelled_are_never_good(exercise):
    """A failed or cancelled request is not good, however fast its tokens were; neither is one with no tokens."""
    for status in ("failed", "cancelled"):
        assert not exercise.meets_slo(_request(0.0, [0.1, 0.2], status=status), 0.5, 0.2)
    assert not exercise.meets_slo(_request(0.0, [], finish_s=0.1), 0.5, 0.2)


@pytest.mark.points(2)
def test_attainment(exercise):
    """Attainment divides by all requests, failed and cancelled included; an empty run gives math.nan."""
    requests = [
        _request(0.0, [0.1, 0.2]),
        _request(0.0, [0.1, 0.2], status="failed"),
        _request(0.0, [0.9, 1.0]),
        _request(0.0, [0.1], status="cancelled"),
    ]
    assert exercise.attainment(requests, 0.5, 0.2) == pytest.approx(0.25)
    assert math.isnan(exercise.attainment([], 0.5, 0.2))


@pytest.mark.points(3)
def test_goodput(exercise):
    """Goodput = good requests / window seconds; failures add nothing; a zero window gives 0.0."""
    requests = [_request(float(i), [i + 0.1, i + 0.2]) for i in range(6)]
    requests[1]["status"] = "failed"
    requests[2]["token_times_s"] = [2.9, 3.0]  # TTFT 0.9 s misses a 0.5 s target
    assert exercise.goodput_rps(requests, 0.5, 0.2, window_s=8.0) == pytest.approx(4 / 8)
    assert exercise.goodput_rps([], 0.5, 0.2, window_s=0.0) == 0.0


@pytest.mark.points(3)
def test_goodput_agrees_with_minserve(exercise):
    """On many random requests your goodput must equal minserve.slo.goodput_rps for the same SLO."""
    rng = random.Random(7)
    requests, records = [], []
    for i in range(200):
        arrival = i * 0.1
        times = list(_token_times(arrival + rng.uniform(0.01, 1.0), rng.randint(1, 12), rng))
        status = rng.choice(["ok"] * 8 + ["failed", "cancelled"])
        requests.append(_request(arrival, times, times[-1] + 0.001, status))
        records.append(slo.RequestRecord(arrival, times, times[-1] + 0.001, status))
    target = slo.SLO(ttft_s=0.5, tpot_s=0.1)
    expected = slo.goodput_rps(records, target, window=25.0)
    assert exercise.goodput_rps(requests, 0.5, 0.1, window_s=25.0) == pytest.approx(expected)


def _token_times(first_s, n, rng):
    """n increasing token times starting at first_s, gaps of 10–200 ms."""
    t = first_s
    for _ in range(n):
        yield t
        t += rng.uniform(0.01, 0.2)

"""Chapter 01's hidden tests (``minserve grade ch01 --hidden``): the public tests' measures on other requests,
seeds, SLOs and edge values (ties, negatives, a metric exactly on its target), so a file fitted to the public
tests' numbers does not pass these. Instructors only: this file sits under ``exercises/solutions/``, which
the learner's copy of the course never holds. Everything is checked against ``minserve.slo``.
"""

from __future__ import annotations

import random

import pytest

from minserve import slo
from minserve.request_record import RequestRecord


def _requests(seed: int, n: int) -> tuple[list[dict], list[RequestRecord]]:
    """``n`` requests a second apart: 1–20 tokens at gaps of 1 ms–0.5 s, a tenth failed or cancelled."""
    rng = random.Random(seed)
    dicts, records = [], []
    for i in range(n):
        arrival = 0.5 * i
        first = arrival + rng.uniform(0.001, 2.0)
        times = [first]
        for _ in range(rng.randint(0, 19)):
            times.append(times[-1] + rng.uniform(0.001, 0.5))
        finish = times[-1] + rng.uniform(0.0, 0.05)
        status = rng.choice(["ok"] * 18 + ["failed", "cancelled"])
        dicts.append({"arrival_s": arrival, "token_times_s": times, "finish_s": finish, "status": status})
        records.append(RequestRecord(arrival, times, finish, status))
    return dicts, records


@pytest.mark.points(3)
def test_each_metric_agrees_with_minserve_on_other_requests(exercise):
    """TTFT, ITL, E2E and TPOT of 300 other requests, 1 to 20 tokens each, equal minserve's."""
    dicts, records = _requests(seed=2024, n=300)
    for request, record in zip(dicts, records, strict=True):
        arrival, times, finish = request["arrival_s"], request["token_times_s"], request["finish_s"]
        assert exercise.ttft_s(arrival, times) == pytest.approx(record.ttft_s)
        assert exercise.itl_s(times) == pytest.approx(record.itl_s)
        assert exercise.e2e_s(arrival, finish) == pytest.approx(record.e2e_s)
        mine, theirs = exercise.tpot_s(arrival, times, finish), record.tpot_s
        assert (mine is None) == (theirs is None) and (mine is None or mine == pytest.approx(theirs)), (times, mine)


@pytest.mark.points(2)
def test_percentile_on_ties_and_negatives(exercise):
    """Duplicates, negative values and quantiles between ranks (12.5, 99.9) interpolate as minserve's does."""
    rng = random.Random(99)
    for _ in range(40):
        values = [rng.choice([-2.0, -0.5, 0.0, 0.5, 3.0, rng.uniform(-5, 5)]) for _ in range(rng.randint(1, 25))]
        for q in (0, 12.5, 50, 99.9, 100):
            assert exercise.percentile(values, q) == pytest.approx(slo.percentile(values, q)), (values, q)


@pytest.mark.points(2)
def test_a_metric_exactly_on_its_target_meets_it(exercise):
    """The targets are inclusive: a TTFT or a TPOT exactly equal to its target meets it (≤, not <)."""
    on_both = {"arrival_s": 0.0, "token_times_s": [0.25, 0.375, 0.5], "finish_s": 0.5, "status": "ok"}
    assert exercise.meets_slo(on_both, 0.25, 0.125)
    assert not exercise.meets_slo(on_both, 0.125, 0.125) and not exercise.meets_slo(on_both, 0.25, 0.0625)


@pytest.mark.points(3)
def test_attainment_and_goodput_under_another_slo(exercise):
    """Attainment and goodput of 400 other requests under a 0.3 s TTFT and a 50 ms TPOT equal minserve's."""
    dicts, records = _requests(seed=31, n=400)
    target = slo.SLO(ttft_s=0.3, tpot_s=0.05)
    assert exercise.attainment(dicts, 0.3, 0.05) == pytest.approx(slo.attainment(records, target)["all"])
    expected = slo.goodput_rps(records, target, window=210.0)
    assert exercise.goodput_rps(dicts, 0.3, 0.05, window_s=210.0) == pytest.approx(expected)

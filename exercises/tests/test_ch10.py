"""Graded tests for chapter 10 (``minserve grade ch10``). Each test's docstring is the hint a learner sees.

Records are dicts shaped like the lines of ``records.jsonl`` (without the derived ``*_ms`` fields). Most
hand-made examples use times that are multiples of 1/8 s, so every difference is exact in binary floating
point and a request sitting exactly on an SLO bound is exactly on it. The property tests draw random runs
with hypothesis on a grid of 1/1024 s (exact for the same reason) and compare the learner's numbers with
what ``minserve bench`` itself computes from the same requests: ``minserve.bench.metrics`` turns each one
into a ``minserve.slo.RequestRecord``, and ``minserve.slo`` does the percentiles and the goodput.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import slo
from minserve.bench import metrics
from minserve.bench.client import RequestResult

PROPERTY = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TICK_S = 1 / 1024  # a power of two: sums and differences of whole ticks are exact floats


def _record(sent_s, chunks, end_s=None, status="ok", output_tokens=None, intended_s=None, run="rate=1", index=0):
    """One line of ``records.jsonl`` as a dict; by default sent on time and ending at the last chunk.

    ``output_tokens`` defaults to the number of chunks (a server that sent no usage); give it to play a
    server whose usage count says more tokens came than chunks.
    """
    return {
        "run": run,
        "index": index,
        "intended_s": sent_s if intended_s is None else intended_s,
        "sent_s": sent_s,
        "chunk_times_s": list(chunks),
        "end_s": (chunks[-1] if chunks else sent_s) if end_s is None else end_s,
        "status": status,
        "error": {"ok": None, "failed": "timeout", "cancelled": None}[status],
        "error_message": None,
        "output_tokens": len(chunks) if output_tokens is None else output_tokens,
        "prompt_tokens": 16,
        "output_tokens_source": "chunks" if output_tokens is None else "usage",
        "text": "x" * len(chunks),
    }


RESULT_FIELDS = {field.name for field in dataclasses.fields(RequestResult)}


def _bench_result(record):
    """The record as ``minserve bench`` holds it in memory: its ``RequestResult``."""
    return RequestResult(**{key: value for key, value in record.items() if key in RESULT_FIELDS})


def _slo_records(run):
    """The records as ``minserve bench`` hands them to ``minserve.slo``: one timestamp per output token."""
    return [metrics.to_slo_record(_bench_result(record)) for record in run]


# Eight requests of one run, used by several tests below. With the SLO {"ttft": 0.5, "tpot": 0.125}:
RUN = [
    _record(0.0, [0.25, 0.375, 0.5], index=0),  # A: TTFT .25, TPOT (.5 − .25)/2 = .125 (on the bound): good
    _record(1.0, [2.0, 2.125], index=1),  # B: TTFT 1.0: misses TTFT
    _record(2.0, [2.25, 3.25], index=2),  # C: TPOT 1.0: misses TPOT
    _record(3.0, [3.5], index=3),  # D: one token, TTFT .5 (on the bound), no TPOT: good
    _record(4.0, [4.125, 4.25], status="failed", index=4),  # E: fast, but failed: never good
    _record(5.0, [5.125], end_s=5.25, status="cancelled", index=5),  # F: cancelled: never good
    _record(6.0, [6.125, 6.625], output_tokens=5, index=6),  # G: 5 tokens in 2 chunks: TPOT .5/4 = .125: good
    _record(7.0, [], end_s=7.5, index=7),  # H: "ok" but not one chunk came: misses TTFT
]
SLO = {"ttft": 0.5, "tpot": 0.125}


@st.composite
def records(draw, run="rate=1"):
    """A random record on the 1/1024 s grid: late or on time, 0–6 chunks, maybe a larger usage count."""
    intended_s = draw(st.integers(0, 4096)) * TICK_S
    sent_s = intended_s + draw(st.integers(0, 256)) * TICK_S
    chunks, t = [], sent_s
    for gap in draw(st.lists(st.integers(0, 600), max_size=6)):
        t += gap * TICK_S
        chunks.append(t)
    end_s = t + draw(st.integers(0, 64)) * TICK_S
    status = draw(st.sampled_from(["ok", "ok", "ok", "failed", "cancelled"]))
    extra_tokens = draw(st.integers(0, 30)) if chunks and draw(st.booleans()) else None
    output_tokens = None if extra_tokens is None else len(chunks) + extra_tokens
    return _record(sent_s, chunks, end_s, status, output_tokens, intended_s, run)


slos = st.fixed_dictionaries(
    {},
    optional={
        "ttft": st.integers(1, 600).map(lambda ticks: ticks * TICK_S),
        "tpot": st.integers(1, 300).map(lambda ticks: ticks * TICK_S),
        "e2e": st.integers(1, 2000).map(lambda ticks: ticks * TICK_S),
    },
)


# --- part 1: one request -----------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_request_metrics_by_hand(exercise):
    """Measure from sent_s: TTFT = first chunk − sent_s, E2E = end_s − sent_s, TPOT = (E2E − TTFT) / (n − 1)."""
    # Intended at 0.5, sent at 1.0; chunks at 1.25, 1.5, 1.75; the stream ends at 2.0.
    # TTFT = 0.25, E2E = 1.0, TPOT = (1.0 − 0.25) / (3 − 1) = 0.375 (the tail after the last chunk counts).
    record = _record(1.0, [1.25, 1.5, 1.75], end_s=2.0, intended_s=0.5)
    assert exercise.request_metrics(record) == pytest.approx({"ttft_s": 0.25, "tpot_s": 0.375, "e2e_s": 1.0})


@pytest.mark.points(2)
def test_tpot_divides_by_the_usage_count(exercise):
    """n is output_tokens (the server's usage count), not len(chunk_times_s): one chunk can carry many tokens."""
    # The curriculum's example: TTFT 80 ms, E2E 2200 ms, 220 tokens → (2.2 − 0.08) / 219 = 9.68 ms, even
    # though the text came in only 3 chunks (dividing by 3 − 1 would give 1060 ms).
    record = _record(0.0, [0.080, 1.0, 2.2], end_s=2.2, output_tokens=220)
    assert exercise.request_metrics(record)["tpot_s"] * 1e3 == pytest.approx(9.68, abs=0.005)


@pytest.mark.points(1)
def test_undefined_metrics_are_none(exercise):
    """No chunk: TTFT and TPOT are None (E2E is still end − sent). One token: TPOT is None, not a division by 0."""
    refused = _record(0.0, [], end_s=0.25, status="failed")  # e.g. an HTTP 429: the error came after 0.25 s
    assert exercise.request_metrics(refused) == {"ttft_s": None, "tpot_s": None, "e2e_s": 0.25}
    one_token = exercise.request_metrics(_record(0.0, [0.5], end_s=0.625))
    assert one_token["tpot_s"] is None
    assert one_token["ttft_s"] == pytest.approx(0.5) and one_token["e2e_s"] == pytest.approx(0.625)


@pytest.mark.points(1)
@PROPERTY
@given(record=records())
def test_request_metrics_match_records_jsonl(exercise, record):
    """Your TTFT/TPOT/E2E must equal the ttft_ms/tpot_ms/e2e_ms minserve bench writes (÷ 1000) for any record."""
    theirs = metrics.per_request_metrics(_bench_result(record))
    mine = exercise.request_metrics(record)
    for name in ("ttft", "tpot", "e2e"):
        expected = theirs[f"{name}_ms"]
        assert (mine[f"{name}_s"] is None) == (expected is None), name
        if expected is not None:
            assert mine[f"{name}_s"] == pytest.approx(expected / 1e3), name


# --- part 2: one run ---------------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_percentile(exercise):
    """Sort, then interpolate at position q/100 × (n − 1); nan for no values; ValueError for q outside [0, 100]."""
    assert exercise.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert exercise.percentile([4.0, 1.0, 3.0, 2.0], 100) == pytest.approx(4.0)
    assert exercise.percentile([0.05] * 99 + [2.0], 99) == pytest.approx(0.0695)  # 0.05 + 1.95 × 0.01
    assert math.isnan(exercise.percentile([], 99))
    with pytest.raises(ValueError):
        exercise.percentile([1.0], -1)
    values = [3.0, 1.0, 2.0]
    exercise.percentile(values, 50)
    assert values == [3.0, 1.0, 2.0]


@pytest.mark.points(1)
@PROPERTY
@given(values=st.lists(st.floats(0, 1e4), min_size=1, max_size=50), q=st.floats(0, 100))
def test_percentile_matches_minserve(exercise, values, q):
    """Use exactly the course's definition (minserve.slo.percentile, numpy's default), or your p99 won't match."""
    assert exercise.percentile(values, q) == pytest.approx(slo.percentile(values, q))


@pytest.mark.points(2)
def test_summarize_by_hand(exercise):
    """Count every status, but put only ok requests' latencies into the percentiles; skip a metric that is None."""
    summary = exercise.summarize(RUN)
    assert {key: summary[key] for key in ("requests", "ok", "failed", "cancelled")} == {
        "requests": 8,
        "ok": 6,
        "failed": 1,
        "cancelled": 1,
    }
    # ok TTFTs (H has none): .25 1.0 .25 .5 .125 → sorted .125 .25 .25 .5 1.0; p90 at rank 3.6: .5 + .5 × .6.
    assert summary["ttft_s"] == pytest.approx({"p50": 0.25, "p90": 0.8, "p99": 0.98})
    # ok TPOTs (D and H have none): .125 .125 1.0 .125; p90 at rank 2.7: .125 + .875 × .7 = .7375.
    assert summary["tpot_s"] == pytest.approx({"p50": 0.125, "p90": 0.7375, "p99": 0.97375})
    # ok E2Es: .5 1.125 1.25 .5 .625 .5 (E's .25 and F's .25 left out); p50 at rank 2.5: .5 + .125 × .5.
    assert summary["e2e_s"] == pytest.approx({"p50": 0.5625, "p90": 1.1875, "p99": 1.24375})
    assert set(exercise.summarize(RUN, percentiles=(99.9,))["e2e_s"]) == {"p99.9"}


@pytest.mark.points(1)
def test_summarize_empty_and_all_failed(exercise):
    """An empty run has zero counts; a run with no ok request has nan percentiles (not 0, not an exception)."""
    empty = exercise.summarize([])
    assert (empty["requests"], empty["ok"], empty["failed"], empty["cancelled"]) == (0, 0, 0, 0)
    all_failed = exercise.summarize([_record(float(i), [], end_s=i + 0.5, status="failed") for i in range(3)])
    assert (all_failed["requests"], all_failed["ok"], all_failed["failed"]) == (3, 0, 3)
    for summary in (empty, all_failed):
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            assert set(summary[name]) == {"p50", "p90", "p99"}
            assert all(math.isnan(value) for value in summary[name].values()), name


@pytest.mark.points(1)
@PROPERTY
@given(run=st.lists(records(), max_size=25))
def test_summarize_matches_minserve_bench(exercise, run):
    """On random runs your counts and p50/p90/p99 must equal what minserve bench computes (ok requests only)."""
    mine = exercise.summarize(run)
    assert [mine[key] for key in ("requests", "ok", "failed", "cancelled")] == [
        len(run),
        *(sum(r["status"] == status for r in run) for status in ("ok", "failed", "cancelled")),
    ]
    records = _slo_records(run)
    for name in ("ttft", "tpot", "e2e"):
        values = slo.metric_values_s(records, name)  # what minserve bench's summary takes percentiles of
        for q in (50, 90, 99):
            expected = slo.percentile(values, q)
            assert mine[f"{name}_s"][f"p{q}"] == pytest.approx(expected, nan_ok=True), (name, q)


@pytest.mark.points(2)
def test_meets_slo(exercise):
    """Good = ok and every set target met (≤ counts); one token cannot miss TPOT; no chunk at all misses TTFT."""
    a, b, c, d, _, _, g, h = RUN
    assert [exercise.meets_slo(r, SLO) for r in (a, b, c, d, g, h)] == [True, False, False, True, True, False]
    # Only an E2E target: H's 0.5 s is within it, so without a TTFT target H is good.
    e2e_only = {"e2e": 0.5}
    assert [exercise.meets_slo(r, e2e_only) for r in (a, b, c, d, g, h)] == [True, False, False, True, False, True]
    # No targets at all: every ok request is good.
    assert all(exercise.meets_slo(r, {}) for r in (a, b, c, d, g, h))


@pytest.mark.points(1)
def test_failed_and_cancelled_are_never_good(exercise):
    """A failed or cancelled request is never good, however fast its chunks were, even with no targets set."""
    for record in (RUN[4], RUN[5]):
        assert not exercise.meets_slo(record, SLO)
        assert not exercise.meets_slo(record, {})


@pytest.mark.points(1)
def test_unknown_slo_target_is_an_error(exercise):
    """Raise ValueError for a key other than ttft, tpot, e2e: a typo like "ttft_ms" would otherwise pass everything."""
    with pytest.raises(ValueError):
        exercise.meets_slo(RUN[0], {"ttft_ms": 500})


@pytest.mark.points(2)
def test_goodput_by_hand(exercise):
    """Goodput = good requests / duration; by default the duration is the latest end_s; 0.0 for no time at all."""
    # A, D and G are good (see RUN); the last request ends at 7.5 s.
    assert exercise.goodput_rps(RUN, SLO) == pytest.approx(3 / 7.5)
    assert exercise.goodput_rps(RUN, SLO, duration_s=10.0) == pytest.approx(0.3)
    # The run's clock starts at 0 even when its first request here left at 2 s: D and G good over 7.5 s
    # (first send → last end would be 5.5 s, and would flatter the run).
    assert exercise.goodput_rps(RUN[2:], SLO) == pytest.approx(2 / 7.5)
    # With no targets, goodput is the rate of ok requests: A B C D G H.
    assert exercise.goodput_rps(RUN, {}, duration_s=10.0) == pytest.approx(0.6)
    assert exercise.goodput_rps([], SLO) == 0.0
    assert exercise.goodput_rps(RUN, SLO, duration_s=0.0) == 0.0
    with pytest.raises(ValueError):
        exercise.goodput_rps(RUN, SLO, duration_s=-1.0)


@pytest.mark.points(1)
@PROPERTY
@given(run=st.lists(records(), max_size=25), target=slos, duration_ticks=st.integers(0, 8192))
def test_goodput_matches_minserve_bench(exercise, run, target, duration_ticks):
    """On random runs and SLOs your goodput must equal minserve bench's goodput_rps for the same duration."""
    duration_s = duration_ticks * TICK_S
    contract = slo.SLO(**{f"{key}_s": bound for key, bound in target.items()})
    expected = slo.goodput_rps(_slo_records(run), contract, duration_s)  # what minserve bench reports
    assert exercise.goodput_rps(run, target, duration_s) == pytest.approx(expected)


@pytest.mark.points(2)
def test_runs_are_kept_apart(exercise):
    """Group records by their "run" label (in order of first appearance): each run has its own clock and duration."""
    slow = [_record(0.0, [0.25, 0.375], run="rate=2", index=0), _record(1.0, [2.0], run="rate=2", index=1)]
    fast = [_record(t, [t + 0.125], run="rate=10", index=i) for i, t in enumerate((0.0, 0.25, 0.5, 0.75))]
    runs = exercise.split_runs(slow + fast)
    assert list(runs) == ["rate=2", "rate=10"]  # the sweep's order, not sorted
    assert runs["rate=2"] == slow and runs["rate=10"] == fast
    # rate=2: one good request (the second has TTFT 1.0) over 2.0 s; rate=10: four good over 0.875 s.
    # Pooled, the two runs would read 5 good / 2.0 s = 2.5/s, a rate that neither run had.
    goodput = {label: exercise.goodput_rps(run, SLO) for label, run in runs.items()}
    assert goodput == pytest.approx({"rate=2": 0.5, "rate=10": 4 / 0.875})


# --- part 3: coordinated omission --------------------------------------------------------------------------


@pytest.mark.points(1)
def test_client_lag_and_latency_from_intended(exercise):
    """Lag = sent_s − intended_s; latency from intended = end_s − intended_s = lag + the E2E the client measured."""
    late = _record(1.5, [1.75], end_s=2.0, intended_s=0.25)
    assert exercise.client_lag_s(late) == pytest.approx(1.25)
    assert exercise.e2e_from_intended_s(late) == pytest.approx(1.75)
    on_time = _record(3.0, [3.125], intended_s=3.0)
    assert exercise.client_lag_s(on_time) == 0.0
    assert exercise.e2e_from_intended_s(on_time) == pytest.approx(0.125)


@pytest.mark.points(2)
def test_closed_loop_by_hand(exercise):
    """Send at max(intended time, when the first worker frees up); with several workers, take the one free first."""
    # One worker: request 1 is due at 1 but the worker is busy until 0 + 3; request 2 waits until 3 + 1 = 4;
    # request 3 is due at 10, long after the worker is free, so it leaves on time.
    assert exercise.closed_loop_send_times([0.0, 1.0, 2.0, 10.0], [3.0, 1.0, 1.0, 1.0], 1) == [0.0, 3.0, 4.0, 10.0]
    # Two workers: requests 0 and 1 leave at 0 (busy until 1 and 3); request 2 takes the worker free at 1;
    # that worker is free again at 2, before the other one (3), so request 3 leaves at 2. Handing out
    # workers in turn (0, 1, 0, 1) would wrongly make request 3 wait for the worker busy until 3.
    assert exercise.closed_loop_send_times([0.0, 0.0, 0.0, 0.5], [1.0, 3.0, 1.0, 1.0], 2) == [0.0, 0.0, 1.0, 2.0]


def _reference_send_times(intended_s, service_s, concurrency):
    """The simulation spelled out with a plain list: each request takes the worker that is free first."""
    free_at = [0.0] * concurrency  # the timetables below start at 0, so "free at 0" is "free from the start"
    sent = []
    for intended, service in zip(intended_s, service_s):
        worker = min(range(concurrency), key=free_at.__getitem__)
        sent.append(max(intended, free_at[worker]))
        free_at[worker] = sent[-1] + service
    return sent


@pytest.mark.points(2)
@PROPERTY
@given(
    requests=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 1000)), max_size=30),
    concurrency=st.integers(1, 5),
)
def test_closed_loop_properties(exercise, requests, concurrency):
    """Never send before the intended time, never have more than `concurrency` in flight, never idle while late."""
    intended = sorted(ticks * TICK_S for ticks, _ in requests)  # a timetable is non-decreasing
    service = [ticks * TICK_S for _, ticks in requests]
    sent = exercise.closed_loop_send_times(intended, service, concurrency)
    assert sent == pytest.approx(_reference_send_times(intended, service, concurrency))
    assert all(s >= i for s, i in zip(sent, intended))
    for i, send in enumerate(sent):  # a worker is busy over [send, send + service)
        busy = sum(sent[j] <= send < sent[j] + service[j] for j in range(i))
        assert busy < concurrency
    # Enough workers for everyone: the open loop, nobody waits.
    assert exercise.closed_loop_send_times(intended, service, len(intended) + 1) == pytest.approx(intended)


@pytest.mark.points(1)
def test_closed_loop_edge_cases(exercise):
    """No requests give []; concurrency < 1 and lists of different lengths are ValueErrors."""
    assert exercise.closed_loop_send_times([], [], 3) == []
    with pytest.raises(ValueError):
        exercise.closed_loop_send_times([0.0], [1.0], 0)
    with pytest.raises(ValueError):
        exercise.closed_loop_send_times([0.0, 1.0], [1.0], 2)


@pytest.mark.points(3)
def test_coordinated_omission_hides_the_stall(exercise):
    """A closed-loop client's p99 from sent_s hides the stall; the p99 from intended_s (end − intended) shows it."""
    # 100 requests due every 0.1 s; each takes 0.05 s, but request 10 hits a 2 s stall.
    intended = [i / 10 for i in range(100)]
    service = [2.0 if i == 10 else 0.05 for i in range(100)]
    sent = exercise.closed_loop_send_times(intended, service, 1)
    run = [_record(s, [s + t], intended_s=i, index=k) for k, (i, s, t) in enumerate(zip(intended, sent, service))]
    # Request 10 runs from 1.0 to 3.0; request 10 + k (due at 1.0 + 0.1k) leaves at 3.0 + 0.05(k − 1): late
    # by 1.95 − 0.05k for k = 1 … 38, until the timetable catches up at k = 39 (4.9 s).
    lags = [exercise.client_lag_s(r) for r in run]
    assert sum(lag > 1e-9 for lag in lags) == 38
    assert max(lags) == pytest.approx(1.9)
    # From sent: 99 × 0.05 and one 2.0 → p99 at rank 98.01 = 0.05 + 1.95 × 0.01 = 0.0695 s, as if one
    # request in a hundred had been slow.
    measured = [exercise.request_metrics(r)["e2e_s"] for r in run]
    p99_measured = exercise.percentile(measured, 99)
    assert p99_measured == pytest.approx(0.0695)
    # From intended: the 38 who queued waited 2.0 − 0.05k (1.95 down to 0.1), so the sorted tail is
    # … 1.90, 1.95, 2.0 → p99 = 1.95 + 0.05 × 0.01 = 1.9505 s: what users arriving on schedule saw.
    corrected = [exercise.e2e_from_intended_s(r) for r in run]
    p99_corrected = exercise.percentile(corrected, 99)
    assert p99_corrected == pytest.approx(1.9505)
    assert p99_corrected >= p99_measured
    assert exercise.percentile(corrected, 90) == pytest.approx(1.505)  # 1.5 + 0.05 × 0.1
    assert exercise.percentile(measured, 90) == pytest.approx(0.05)

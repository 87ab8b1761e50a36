"""Graded tests for chapter 10 (``minserve grade ch10``). Each test's docstring is the hint a learner sees.

Part 1 is checked by hand and, with hypothesis, against a plain simulation of the workers on a grid of
1/1024 s (exact in binary floating point). Part 2 is graded on sweeps of a simulated server
(:mod:`minserve.capacity.sweep_records`: the engine's own scheduler on a virtual clock, each run's requests
written as ``records.jsonl`` lines), whose capacity at the SLO is found exactly by bisection on the rate
(:func:`~minserve.capacity.sweep_records.slo_capacity_rps`, about 43 requests/s for chapter 09's workload
of 200 requests under a 1 s TTFT): an estimate must land within 20% of it.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import slo
from minserve.capacity.experiments import overload_workload
from minserve.capacity.sweep_records import slo_capacity_rps, sweep_records, timetable_rate

PROPERTY = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TICK_S = 1 / 1024  # a power of two: sums and differences of whole ticks are exact floats
SLO = {"ttft": 1.0}
TOLERANCE = 0.2  # an estimate within 20% of the simulated server's capacity passes
OPEN_LOOP = (0.3, 0.6, 0.8, 0.9, 1.1, 1.3, 1.6, 2.0)  # the sweep's rates, as fractions of the capacity


@functools.cache
def _capacity() -> float:
    return slo_capacity_rps(slo.SLO(ttft_s=SLO["ttft"]))


@functools.cache
def _open_sweep() -> tuple[dict, ...]:
    return tuple(sweep_records([f * _capacity() for f in OPEN_LOOP]))


@functools.cache
def _pool_sweep() -> tuple[dict, ...]:
    """On time below the knee; past it, sent by a pool of 8 workers that fell behind (coordinated omission)."""
    below = sweep_records([f * _capacity() for f in (0.3, 0.6, 0.8, 0.9)])
    return tuple(below + sweep_records([f * _capacity() for f in (1.0, 1.25, 1.6, 2.0)], workers=8))


def _within(estimate: float) -> None:
    """Within 20% of the capacity, read either as the rate asked of the load tester (the run's label) or as
    the rate its seeded timetable delivered (its requests over their span: 11% lower for this seed)."""
    asked = _capacity()
    delivered = asked * timetable_rate(overload_workload, 200, seed=0)
    low, high = (1 - TOLERANCE) * min(asked, delivered), (1 + TOLERANCE) * max(asked, delivered)
    assert low <= estimate <= high, (
        f"estimated {estimate:.1f} requests/s; the simulated server's capacity at the SLO is {asked:.1f} "
        f"requests/s asked of the load tester, {delivered:.1f} delivered by its timetable"
    )


# --- part 1: coordinated omission --------------------------------------------------------------------------


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


# --- part 2: the knee ---------------------------------------------------------------------------------------


@pytest.mark.points(3)
def test_capacity_from_an_open_loop_sweep(exercise):
    """Eight runs from 0.3 to 2 times the capacity, each sent on time: the knee within 20% of the capacity."""
    _within(exercise.capacity_rps(list(_open_sweep()), SLO))


@pytest.mark.points(3)
def test_capacity_when_a_pool_of_workers_fell_behind(exercise):
    """Past the knee the runs were sent by 8 workers that fell behind their timetable: measured from when
    they sent, every request looks fast. Judge a run by its timetable (intended_s), as its users waited."""
    _within(exercise.capacity_rps(list(_pool_sweep()), SLO))


@pytest.mark.points(1)
def test_runs_and_records_in_any_order(exercise):
    """The records of a sweep shuffled: the same estimate."""
    records = list(_open_sweep())
    shuffled = random.Random(3).sample(records, len(records))
    assert exercise.capacity_rps(shuffled, SLO) == pytest.approx(exercise.capacity_rps(records, SLO))


@pytest.mark.points(1)
def test_a_sweep_that_never_reached_the_knee(exercise):
    """Every run good enough: the capacity is at least the highest rate the sweep tried; with a bound no run
    meets, at most the lowest. (A Poisson timetable of 200 requests runs within a few percent of its nominal
    rate, so either reading of "the rate tried" passes.)"""
    below = [r for r in _open_sweep() if float(r["run"].removeprefix("rate=")) < 0.85 * _capacity()]
    highest = max(float(r["run"].removeprefix("rate=")) for r in below)
    assert exercise.capacity_rps(below, SLO) >= 0.8 * highest
    lowest = min(float(r["run"].removeprefix("rate=")) for r in below)
    assert exercise.capacity_rps(below, {"ttft": 1e-6}) <= 1.2 * lowest


@pytest.mark.points(1)
def test_an_unknown_slo_target_is_an_error(exercise):
    """Only "ttft" and "e2e" are targets: "ttft_ms" must not quietly pass every request."""
    with pytest.raises(ValueError):
        exercise.capacity_rps(list(_open_sweep())[:20], {"ttft_ms": 1000})

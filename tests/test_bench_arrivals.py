"""Arrival processes: Poisson and gamma gaps have the stated mean; the timetable ignores the server."""

from __future__ import annotations

import asyncio
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.bench.arrivals import OpenLoop, parse_concurrencies
from minserve.bench.client import RequestResult
from minserve.bench.runner import run_closed_loop, run_open_loop
from minserve.bench.workload import BenchRequest
from minserve.workload import inter_arrival_gaps, parse_rates, timetable

SAMPLES = 20000


@given(st.floats(0.1, 1000), st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_poisson_mean_gap_is_one_over_rate(rate, seed):
    gaps = inter_arrival_gaps(SAMPLES, rate, "poisson", seed=seed)
    # The sample mean of n exponential gaps has standard error (1/λ)/√n; 5 standard errors is a safe bound.
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(SAMPLES)


@given(st.floats(0.05, 20), st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_gamma_has_mean_one_over_rate_and_cv_one_over_sqrt_shape(burstiness, seed):
    rate = 4.0
    gaps = inter_arrival_gaps(SAMPLES, rate, "gamma", burstiness, seed)
    cv = 1 / math.sqrt(burstiness)
    assert abs(gaps.mean() - 1 / rate) < 6 * cv * (1 / rate) / math.sqrt(SAMPLES)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_burstiness_below_one_is_burstier_than_poisson():
    cvs = {k: np.std(g) / np.mean(g) for k in (0.25, 1.0, 4.0) for g in [inter_arrival_gaps(SAMPLES, 2.0, "gamma", k)]}
    assert cvs[0.25] > cvs[1.0] > cvs[4.0]


def test_constant_and_infinite_rates():
    assert timetable(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    assert timetable(3, math.inf) == [0.0, 0.0, 0.0]
    assert timetable(0, 1.0) == []


@given(st.integers(1, 200), st.floats(0.1, 100), st.sampled_from(["poisson", "gamma", "constant"]))
@settings(max_examples=50, deadline=None)
def test_timetable_starts_at_zero_and_never_goes_back(n, rate, process):
    times = timetable(n, rate, process, burstiness=0.5, seed=1)
    assert len(times) == n and times[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_timetable_is_seeded():
    assert OpenLoop(3.0, seed=1).timetable(50) == OpenLoop(3.0, seed=1).timetable(50)
    assert OpenLoop(3.0, seed=1).timetable(50) != OpenLoop(3.0, seed=2).timetable(50)


def test_parse_lists():
    assert parse_rates("1, 2,inf") == [1.0, 2.0, math.inf]
    assert parse_concurrencies("1,4,16") == [1, 4, 16]
    with pytest.raises(ValueError):
        OpenLoop(0.0)


# --- the runner keeps to the timetable whatever the server does ----------------------------------------------


def _fake_send(latency_s: float, clock, sent: list[int]):
    async def send(request: BenchRequest, intended_s: float) -> RequestResult:
        sent.append(request.index)
        result = RequestResult(index=request.index, intended_s=intended_s, sent_s=clock())
        await asyncio.sleep(latency_s * (1 + request.index % 3))  # a slow, uneven "server"
        result.end_s = clock()
        return result

    return send


def _run_open(latency_s: float, table: list[float]) -> tuple[list[RequestResult], list[int]]:
    requests = [BenchRequest(i, "x", 1) for i in range(len(table))]
    sent: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()

        def clock() -> float:
            return loop.time() - start

        return await run_open_loop(requests, table, _fake_send(latency_s, clock, sent), clock)

    return asyncio.run(main()), sent


def test_open_loop_intended_times_do_not_depend_on_response_times():
    table = OpenLoop(2000.0, seed=4).timetable(20)
    fast, fast_order = _run_open(0.0, table)
    slow, slow_order = _run_open(0.02, table)
    assert [r.intended_s for r in fast] == [r.intended_s for r in slow] == table
    assert fast_order == slow_order == list(range(20))  # sent in timetable order, slow answers or not
    assert all(r.client_lag_s >= 0 for r in slow)  # never sent early
    # With slow answers, requests overlap: someone was sent before an earlier one finished.
    assert any(b.sent_s < a.end_s for a, b in itertools.pairwise(slow))


def test_closed_loop_keeps_at_most_concurrency_in_flight():
    requests = [BenchRequest(i, "x", 1) for i in range(12)]
    in_flight, peak = 0, 0

    async def send(request: BenchRequest, intended_s: float) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        return RequestResult(index=request.index, intended_s=intended_s, sent_s=intended_s, end_s=intended_s)

    results = asyncio.run(run_closed_loop(requests, 3, send, lambda: 0.0))
    assert [r.index for r in results] == list(range(12)) and peak == 3

"""The pieces of a benchmark that are not the network: salting runs, the offered rate, running from a loop."""

from __future__ import annotations

import asyncio
import math

import pytest

from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.benchmark import salted
from minserve.bench.client import ClientConfig, RequestResult, request_body
from minserve.bench.metrics import offered_rps
from minserve.bench.runner import RunResult, run_sync
from minserve.bench.workload import BenchRequest, WorkloadSpec, build_requests


def test_salting_keeps_the_work_and_a_shared_prefix_but_nothing_across_runs():
    requests = build_requests(WorkloadSpec(num_requests=4, shared_prefix_len=10, shared_prefix_fraction=1.0))
    requests.append(BenchRequest(9, [1, 2, 3], 4))
    first, second = salted(requests, "# run a rate=1"), salted(requests, "# run a rate=2")
    assert [r.prompt for r in first[:4]] == [f"# run a rate=1\n{r.prompt}" for r in requests[:4]]
    assert first[4].prompt == [1, 2, 3]  # token ids are left alone
    assert [(r.index, r.max_tokens) for r in first] == [(r.index, r.max_tokens) for r in requests]
    assert len({r.prompt.split("\n")[1] for r in first[:4]}) == 1  # the shared prefix is still shared
    assert not {r.prompt for r in first[:4]} & {r.prompt for r in second[:4]}


def _run(arrival, intended):
    results = [RequestResult(i, t, t) for i, t in enumerate(intended)]
    return RunResult(arrival.label, arrival, results, 10.0)


def test_offered_rate_is_what_the_timetable_really_sent():
    arrival = OpenLoop(10.0, seed=5)
    timetable = arrival.timetable(48)
    assert offered_rps(_run(arrival, timetable)) == pytest.approx(48 / timetable[-1])
    assert offered_rps(_run(OpenLoop(4.0, "constant"), OpenLoop(4.0, "constant").timetable(5))) == pytest.approx(5.0)
    assert math.isnan(offered_rps(_run(ClosedLoop(2), [0.0, 1.0, 2.0])))  # a closed loop offers no rate


def test_run_sync_works_with_and_without_a_running_loop():
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert run_sync(answer()) == 42

    async def inside_a_loop() -> int:  # as in a notebook cell: asyncio.run would refuse here
        return run_sync(answer())

    assert asyncio.run(inside_a_loop()) == 42

    async def failing() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_sync(failing())


def test_ignore_eos_asks_every_server_dialect_for_exactly_max_tokens():
    request = BenchRequest(0, "hello", 7)
    exact = request_body(ClientConfig("http://x", "m", ignore_eos=True), request)
    assert exact["ignore_eos"] is True and exact["min_tokens"] == exact["max_tokens"] == 7
    plain = request_body(ClientConfig("http://x", "m"), request)
    assert "ignore_eos" not in plain and "min_tokens" not in plain

"""The load tester that causes coordinated omission, kept to be measured, never used to measure.

A fixed pool of workers walks an open-loop timetable: request ``i`` goes to the first free worker, which
sends it at its intended time or, if it was still busy then, the moment it frees up. When the server is
slow the workers fall behind: the load they offer drops exactly when it should not, and the waiting happens
in the client, unseen by a latency measured from the actual send. Chapter 10 runs it beside the honest open
loop of :mod:`minserve.bench.runner` to show the difference; it shares that runner's client and clock
(:func:`~minserve.bench.runner.timed_run`), so the two differ only in how they walk the timetable.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.client import ClientConfig, RequestResult
from minserve.bench.runner import RunResult, Send, run_sync, timed_run
from minserve.bench.workload import BenchRequest


async def workers_on_timetable(
    requests: Sequence[BenchRequest],
    timetable_s: Sequence[float],
    concurrency: int,
    send: Send,
    clock: Callable[[], float],
) -> list[RequestResult]:
    """``concurrency`` workers walk an open-loop timetable (seconds on ``clock``); results in request order.

    ``intended_s`` keeps the timetable's time, so the lag a busy worker adds stays visible in the records.
    """
    pending = iter(enumerate(zip(requests, timetable_s)))  # shared: next() never yields, so no lock is needed
    results: list[RequestResult | None] = [None] * len(requests)

    async def worker() -> None:
        for position, (request, intended_s) in pending:
            delay_s = intended_s - clock()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            results[position] = await send(request, intended_s)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [r for r in results if r is not None]


def run_with_workers(
    client: ClientConfig,
    requests: Sequence[BenchRequest],
    arrival: OpenLoop,
    concurrency: int,
    label: str | None = None,
) -> RunResult:
    """One run of :func:`workers_on_timetable` against a real server, labelled ``rate=…, N workers`` by default.

    Its arrival is recorded as ``ClosedLoop(concurrency)``: at most that many are ever in flight, whatever
    the timetable asked for.
    """
    walk = functools.partial(workers_on_timetable, requests, arrival.timetable(len(requests)), concurrency)
    results, duration_s, client_cpu_s = run_sync(timed_run(client, walk))
    name = label or f"{arrival.label}, {concurrency} workers"
    return RunResult(name, ClosedLoop(concurrency), results, duration_s, client_cpu_s)

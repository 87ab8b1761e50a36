"""Run a workload on an arrival process: open loop on a timetable, or closed loop at a concurrency.

The open loop is one coroutine that walks the precomputed timetable: it sleeps until each intended send
time and starts that request as its own task, never waiting for an answer. However slow the server is, the
next request leaves on time (if the client itself falls behind, the lag is recorded, not hidden).

Connections are not pooled down to a fixed number: a capped pool would make requests queue *inside the
client*, which is coordinated omission by another name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from tqdm import tqdm

from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.client import ClientConfig, RequestResult, send_request, send_with_retries
from minserve.bench.workload import BenchRequest

T = TypeVar("T")
# (request, intended send offset in seconds) → what the client saw; the runner needs nothing else.
Send = Callable[[BenchRequest, float], Awaitable[RequestResult]]


@dataclass
class RunResult:
    """One run: its label (``rate=2``, ``concurrency=4``), every request's result, and its wall time in s.

    ``client_cpu_s`` is the CPU time the load tester's own process spent during the run: when it nears
    ``duration_s`` the client was saturated, and its timings say more about itself than about the server.
    """

    label: str
    arrival: OpenLoop | ClosedLoop
    results: list[RequestResult]
    duration_s: float
    client_cpu_s: float = 0.0


async def run_open_loop(
    requests: Sequence[BenchRequest], timetable_s: Sequence[float], send: Send, clock: Callable[[], float]
) -> list[RequestResult]:
    """Send ``requests[i]`` at ``timetable_s[i]`` seconds on ``clock``; results in request order."""
    tasks = []
    for request, intended_s in zip(requests, timetable_s):
        delay_s = intended_s - clock()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(send(request, intended_s)))
    return list(await asyncio.gather(*tasks))


async def run_closed_loop(
    requests: Sequence[BenchRequest], concurrency: int, send: Send, clock: Callable[[], float]
) -> list[RequestResult]:
    """``concurrency`` workers, each sending its next request the moment its last one ended."""
    pending = iter(enumerate(requests))  # shared by the workers; next() never yields, so no lock is needed
    results: list[RequestResult | None] = [None] * len(requests)

    async def worker() -> None:
        for position, request in pending:
            results[position] = await send(request, clock())  # intended = now: a closed loop has no timetable

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [r for r in results if r is not None]


# What a run's loop does with the client: send every request through ``send``, reading time on ``clock``.
Walk = Callable[[Send, Callable[[], float]], Awaitable[list[RequestResult]]]


async def timed_run(
    config: ClientConfig, walk: Walk, on_result: Callable[[], None] = lambda: None
) -> tuple[list[RequestResult], float, float]:
    """Open the run's HTTP client, start its clock, and let ``walk`` send through them.

    Returns the results, the run's wall time and the client's CPU time over it (both seconds). This is the
    one place a run's client is made: every load shape (open loop, closed loop, the workers of
    :mod:`minserve.bench.omission`) measures on the same connections, timeout and clock, and retries (when
    ``config.make_retrier`` is set) with one retrier per run. ``on_result`` is called after each request
    ends (a progress bar).
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.wait_s)) as http:
        # The clock starts once the client exists: building it (an SSL context, ~30 ms) is no request's lag.
        start, cpu_start = time.perf_counter(), time.process_time()

        def clock() -> float:
            return time.perf_counter() - start

        retrier = config.make_retrier() if config.make_retrier is not None else None

        async def send(request: BenchRequest, intended_s: float) -> RequestResult:
            if retrier is None:
                result = await send_request(http, config, request, intended_s, clock)
            else:
                result = await send_with_retries(http, config, request, intended_s, clock, retrier)
            on_result()
            return result

        results = await walk(send, clock)
        duration_s = clock()  # the last request has ended; closing the pool is not part of the run
        client_cpu_s = time.process_time() - cpu_start
    return results, duration_s, client_cpu_s


async def run_once(
    requests: Sequence[BenchRequest],
    arrival: OpenLoop | ClosedLoop,
    config: ClientConfig,
    progress: bool = True,
) -> RunResult:
    """One run of ``requests`` against the server in ``config``, open or closed loop."""
    walk: Walk
    if isinstance(arrival, OpenLoop):
        walk = functools.partial(run_open_loop, requests, arrival.timetable(len(requests)))
    else:
        walk = functools.partial(run_closed_loop, requests, arrival.concurrency)
    bar = tqdm(total=len(requests), desc=arrival.label, unit="req", disable=not progress, leave=False)
    results, duration_s, client_cpu_s = await timed_run(config, walk, lambda: bar.update(1))
    bar.close()
    return RunResult(arrival.label, arrival, results, duration_s, client_cpu_s)


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code, also where an event loop is already running.

    A notebook cell runs inside the kernel's event loop, where ``asyncio.run`` refuses to start another:
    there the coroutine runs in a worker thread, which has no loop of its own.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()

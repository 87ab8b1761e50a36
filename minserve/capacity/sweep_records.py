"""A load test's records made by the simulator, and the capacity they should reveal, known exactly.

``minserve bench`` writes one ``records.jsonl`` line per request; chapter 10's exercise estimates a server's
capacity from such lines. To grade an estimate we need records whose right answer is known: here the
simulated engine (the real scheduler on a virtual clock) serves each run of a rate sweep, its requests become
records of the same shape, and :func:`slo_capacity_rps` finds the true answer by bisection on the rate.

Two kinds of load tester are simulated. The honest open loop sends each request when the timetable says.
A fixed pool of workers (:func:`pool_send_times`) sends a request only when a worker is free, so past the
knee it falls behind its timetable and the server sees less load than was intended: coordinated omission.
Its records keep the timetable's ``intended_s`` beside the late ``sent_s``, as ``minserve bench`` does, so
the stall it hid can be put back. The pool's send times depend on how long the server takes, which depends
on the send times; :func:`sweep_records` finds them by rounds of simulating and re-timing, an
approximation of a closed loop (the simulator takes arrival times fixed in advance).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

from minserve import slo
from minserve.capacity.cost_model import StepCostModel
from minserve.capacity.experiments import OVERLOAD_CONFIG, TINY_CPU_COST, overload_workload
from minserve.capacity.simulator import SimRequest, SimulatedRequest, Simulator
from minserve.config import SchedulerConfig

Workload = Callable[[int, float, int], Sequence[SimRequest]]  # (requests, rate req/s, seed) → requests
POOL_ROUNDS = 8  # serve, re-time the pool's sends, serve again: rounds until the send times settle


def pool_send_times(intended_s: Sequence[float], service_s: Sequence[float], workers: int) -> list[float]:
    """When ``workers`` workers walking a timetable send each request: at its intended time or, if every
    worker is busy then, when the first one frees up (a request ``i`` keeps its worker ``service_s[i]``)."""
    free_at = [-math.inf] * min(workers, len(intended_s))
    sent = []
    for intended, service in zip(intended_s, service_s, strict=True):
        send = max(intended, heapq.heappop(free_at))
        sent.append(send)
        heapq.heappush(free_at, send + service)
    return sent


def sweep_records(
    rates_rps: Sequence[float],
    workload: Workload = overload_workload,
    num_requests: int = 200,
    seed: int = 0,
    workers: int | None = None,
    cost: StepCostModel = TINY_CPU_COST,
    config: SchedulerConfig = OVERLOAD_CONFIG,
) -> list[dict]:
    """Records of a rate sweep, run after run, each labelled ``rate=R`` (``rate=R workers=N`` when a pool of
    ``workers`` sent them): the dicts ``records.jsonl`` holds, each run's clock starting at 0 (seconds)."""
    records = []
    for rate in rates_rps:
        requests = list(workload(num_requests, rate, seed))
        intended = [r.arrival_s for r in requests]
        sent = _pool_fixed_point(requests, intended, workers, cost, config) if workers else intended
        served = _serve(requests, sent, cost, config)
        label = f"rate={rate:g}" + (f" workers={workers}" if workers else "")
        records += [_record(label, i, r, t, s) for i, (r, t, s) in enumerate(zip(served, intended, sent, strict=True))]
    return records


def slo_capacity_rps(
    target: slo.SLO,
    workload: Workload = overload_workload,
    num_requests: int = 200,
    seed: int = 0,
    attainment: float = 0.9,
    cost: StepCostModel = TINY_CPU_COST,
    config: SchedulerConfig = OVERLOAD_CONFIG,
    iterations: int = 14,
) -> float:
    """The highest arrival rate (req/s, open loop) at which at least ``attainment`` of the requests meet
    ``target``: bisection between 0 and a rate where it fails, on the same seeded workload."""

    def meets(rate: float) -> bool:
        served = Simulator(cost, config).run(workload(num_requests, rate, seed)).requests
        return slo.attainment([r.record for r in served], target)["all"] >= attainment

    low, high = 0.0, 1.0
    while meets(high):
        low, high = high, 2 * high
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


def timetable_rate(workload: Workload, num_requests: int, seed: int = 0) -> float:
    """The rate a seeded timetable delivers per request/s asked of it: its requests, one gap each after the
    first, over the span of their arrivals at 1 request/s. Poisson gaps scale as 1 / rate, so this is one
    factor for every rate of a sweep (0.885 for chapter 09's workload of 200 requests, seed 0)."""
    arrivals = sorted(r.arrival_s for r in workload(num_requests, 1.0, seed))
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def _pool_fixed_point(
    requests: Sequence[SimRequest], intended_s: list[float], workers: int, cost: StepCostModel, config: SchedulerConfig
) -> list[float]:
    """Send times a pool of ``workers`` settles on: serve, re-time the sends from the service times seen,
    serve again. Each round moves half way to the new times, since the full step swings between a flood (no
    one waited, so service is slow, so everyone waits) and a trickle; within :data:`POOL_ROUNDS` rounds the
    pool's in-flight count stays near ``workers`` (10–20 for 8 workers on chapter 09's workload)."""
    sent = list(intended_s)
    for _ in range(POOL_ROUNDS):
        served = _serve(requests, sent, cost, config)
        service = [r.metrics.finish_time_s - s for r, s in zip(served, sent, strict=True)]
        retimed = pool_send_times(intended_s, service, workers)
        sent = [max(i, (old + new) / 2) for i, old, new in zip(intended_s, sent, retimed, strict=True)]
    served = _serve(requests, sent, cost, config)
    service = [r.metrics.finish_time_s - s for r, s in zip(served, sent, strict=True)]
    return pool_send_times(intended_s, service, workers)


def _serve(
    requests: Sequence[SimRequest], arrivals_s: Sequence[float], cost: StepCostModel, config: SchedulerConfig
) -> list[SimulatedRequest]:
    """The requests served arriving at ``arrivals_s``, in the given order."""
    moved = [
        dataclasses.replace(r, arrival_s=a, request_id=str(i)) for i, (r, a) in enumerate(zip(requests, arrivals_s))
    ]
    served = {r.request_id: r for r in Simulator(cost, config).run(moved).requests}
    return [served[str(i)] for i in range(len(moved))]


def _record(run: str, index: int, served: SimulatedRequest, intended_s: float, sent_s: float) -> dict:
    """One ``records.jsonl`` line: a chunk per token, the server's own count of them, status ``ok`` unless
    the engine stopped the request."""
    metrics = served.metrics
    return {
        "run": run,
        "index": index,
        "intended_s": intended_s,
        "sent_s": sent_s,
        "chunk_times_s": list(metrics.token_times_s),
        "end_s": metrics.finish_time_s,
        "status": "ok" if served.finish_reason == "length" else "failed",
        "error": None if served.finish_reason == "length" else served.finish_reason,
        "error_message": None,
        "output_tokens": len(metrics.token_times_s),
        "prompt_tokens": served.prompt_tokens,
        "output_tokens_source": "usage",
        "text": "",
    }

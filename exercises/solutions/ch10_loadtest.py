"""Chapter 10 exercise, reference solutions (instructors: ``minserve grade ch10 --solutions``)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

SLO_KEYS = ("ttft", "e2e")


def closed_loop_send_times(intended_s: Sequence[float], service_s: Sequence[float], concurrency: int) -> list[float]:
    """Actual send times of a timetable walked in order by ``concurrency`` workers (never before intended)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be ≥ 1, got {concurrency}")
    if len(intended_s) != len(service_s):
        raise ValueError(f"{len(intended_s)} intended times but {len(service_s)} service times")
    # A heap of the times each worker is next free; more workers than requests would never be used.
    free_at = [-math.inf] * min(concurrency, len(intended_s))
    sent = []
    for intended, service in zip(intended_s, service_s):
        first_free = heapq.heappop(free_at)
        send = max(intended, first_free)  # wait for the timetable, or for a worker: whichever comes later
        sent.append(send)
        heapq.heappush(free_at, send + service)
    return sent


def capacity_rps(records: Sequence[dict], slo: dict[str, float], attainment: float = 0.9) -> float:
    """The rate where the sweep's share of good requests crosses ``attainment``, interpolated between the
    highest run that reached it and the next run above it that did not."""
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO targets {sorted(unknown)}; use {SLO_KEYS}")
    runs: dict[str, list[dict]] = {}
    for record in records:
        runs.setdefault(record["run"], []).append(record)
    points = sorted((_offered_rps(run), _good_share(run, slo)) for run in runs.values())
    passing = [(rate, share) for rate, share in points if share >= attainment]
    if not passing:
        return 0.0
    rate, share = max(passing)
    above = [(r, s) for r, s in points if r > rate and s < attainment]
    if not above:
        return rate
    next_rate, next_share = min(above)
    return rate + (next_rate - rate) * (share - attainment) / (share - next_share)


def _offered_rps(run: Sequence[dict]) -> float:
    """The rate the run's timetable intended (a pool that fell behind sent less): requests over the span of
    their intended send times, one gap per request after the first."""
    intended = sorted(record["intended_s"] for record in run)
    span = intended[-1] - intended[0]
    return (len(intended) - 1) / span if span > 0 else math.inf


def _good_share(run: Sequence[dict], slo: dict[str, float]) -> float:
    """The share of the run's requests that are ok and within every bound, timed from the intended send:
    what a user arriving on schedule waited, the client's own lag included."""
    return sum(_good(record, slo) for record in run) / len(run)


def _good(record: dict, slo: dict[str, float]) -> bool:
    if record["status"] != "ok":
        return False
    start = record["intended_s"]
    waited = {"e2e": record["end_s"] - start}
    if "ttft" in slo:
        if not record["chunk_times_s"]:
            return False
        waited["ttft"] = record["chunk_times_s"][0] - start
    return all(waited[key] <= bound for key, bound in slo.items())

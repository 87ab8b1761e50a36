"""Chapter 10 exercise, reference solutions (instructors: ``minserve grade ch10 --solutions``)."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence

SLO_METRICS = ("ttft", "tpot", "e2e")


# --- part 1: one request -----------------------------------------------------------------------------------


def request_metrics(record: dict) -> dict[str, float | None]:
    """TTFT, TPOT and E2E of one record in seconds, from ``sent_s``; ``None`` where undefined."""
    chunks, n = record["chunk_times_s"], record["output_tokens"]
    e2e = record["end_s"] - record["sent_s"]
    ttft = chunks[0] - record["sent_s"] if chunks else None
    # n is the server's token count: a chunk can carry several tokens, so len(chunks) would undercount.
    tpot = (e2e - ttft) / (n - 1) if ttft is not None and n >= 2 else None
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}


# --- part 2: one run ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100), linear interpolation; ``nan`` when empty, ValueError for bad q."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)  # sorted() copies: the caller's list stays as it was
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: Sequence[dict], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """Status counts, and percentiles (seconds) of TTFT, TPOT and E2E over the ok requests."""
    statuses = Counter(record["status"] for record in records)
    summary: dict = {"requests": len(records), **{status: statuses[status] for status in ("ok", "failed", "cancelled")}}
    ok_metrics = [request_metrics(record) for record in records if record["status"] == "ok"]
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        values = [metrics[name] for metrics in ok_metrics if metrics[name] is not None]
        summary[name] = {f"p{q:g}": percentile(values, q) for q in percentiles}
    return summary


def meets_slo(record: dict, slo: dict[str, float]) -> bool:
    """Good = status ok and every target met (≤); a missing TPOT cannot miss, a missing TTFT does."""
    unknown = set(slo) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO targets {sorted(unknown)}; expected some of {SLO_METRICS}")
    if record["status"] != "ok":
        return False
    metrics = request_metrics(record)
    for key, bound_s in slo.items():
        value = metrics[f"{key}_s"]
        if value is None:
            if key == "tpot":
                continue  # fewer than two tokens: nothing after the first token to be slow
            return False  # an ok answer without a single chunk never showed the user anything
        if value > bound_s:
            return False
    return True


def goodput_rps(records: Sequence[dict], slo: dict[str, float], duration_s: float | None = None) -> float:
    """Good requests per second over ``duration_s`` (default: the latest ``end_s``); 0.0 for no time."""
    if duration_s is None:
        duration_s = max((record["end_s"] for record in records), default=0.0)
    if duration_s < 0:
        raise ValueError(f"duration_s must be ≥ 0, got {duration_s}")
    good = sum(meets_slo(record, slo) for record in records)
    return good / duration_s if duration_s > 0 else 0.0


def split_runs(records: Sequence[dict]) -> dict[str, list[dict]]:
    """The records grouped by ``"run"``, in order of first appearance (dicts keep insertion order)."""
    runs: dict[str, list[dict]] = {}
    for record in records:
        runs.setdefault(record["run"], []).append(record)
    return runs


# --- part 3: coordinated omission --------------------------------------------------------------------------


def client_lag_s(record: dict) -> float:
    """``sent_s`` − ``intended_s``, seconds: how far the client fell behind its timetable."""
    return record["sent_s"] - record["intended_s"]


def e2e_from_intended_s(record: dict) -> float:
    """``end_s`` − ``intended_s``, seconds: the latency a user arriving on schedule saw."""
    return record["end_s"] - record["intended_s"]


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

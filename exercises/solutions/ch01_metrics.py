"""Chapter 01 exercise, reference solutions (instructors: ``minserve grade ch01 --solutions``)."""

from __future__ import annotations

import itertools
import math


def ttft_s(arrival_s: float, token_times_s: list[float]) -> float | None:
    """Time to first token: arrival → first output token, in seconds. ``None`` when no token came."""
    return token_times_s[0] - arrival_s if token_times_s else None


def itl_s(token_times_s: list[float]) -> list[float]:
    """Inter-token latencies: the gaps between consecutive tokens, in seconds (n − 1 of them for n tokens)."""
    return [later - earlier for earlier, later in itertools.pairwise(token_times_s)]


def e2e_s(arrival_s: float, finish_s: float) -> float:
    """End-to-end latency: arrival → finish, in seconds."""
    return finish_s - arrival_s


def tpot_s(arrival_s: float, token_times_s: list[float], finish_s: float) -> float | None:
    """Time per output token *after the first*: (E2E − TTFT) / (n − 1), in seconds; ``None`` for n < 2."""
    n = len(token_times_s)
    if n < 2:
        return None
    return (e2e_s(arrival_s, finish_s) - ttft_s(arrival_s, token_times_s)) / (n - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100), linear interpolation; ``nan`` when empty, ValueError for bad q."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)  # sorted() copies: the caller's list stays as it was
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def meets_slo(request: dict, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Good = status "ok", TTFT ≤ target and TPOT ≤ target (a one-token answer cannot miss TPOT)."""
    if request["status"] != "ok":
        return False
    ttft = ttft_s(request["arrival_s"], request["token_times_s"])
    if ttft is None or ttft > ttft_slo_s:
        return False
    tpot = tpot_s(request["arrival_s"], request["token_times_s"], request["finish_s"])
    return tpot is None or tpot <= tpot_slo_s


def attainment(requests: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Fraction of all requests (failed and cancelled included) that are good; ``nan`` for none."""
    if not requests:
        return math.nan
    return sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in requests) / len(requests)


def goodput_rps(requests: list[dict], ttft_slo_s: float, tpot_slo_s: float, window_s: float) -> float:
    """Good requests per second over ``window_s`` seconds; 0.0 when the window is 0."""
    if window_s <= 0:
        return 0.0
    return sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in requests) / window_s

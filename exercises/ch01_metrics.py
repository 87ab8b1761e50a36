"""Chapter 01 exercise: service metrics from raw token timestamps.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch01

All times are seconds on one monotonic clock; only differences between them mean anything. A request is a
plain dict:

    {"arrival_s": 0.0, "token_times_s": [0.08, 0.12, 0.16], "finish_s": 0.17, "status": "ok"}

``token_times_s[i]`` is when output token i reached the client; ``status`` is "ok", "failed" or
"cancelled". Use only the standard library (``math`` and ``itertools`` are handy): the grader refuses a file
that imports anything else, ``minserve.slo`` included.
"""

from __future__ import annotations

import math  # noqa: F401  (you will want math.nan and math.floor)


def ttft_s(arrival_s: float, token_times_s: list[float]) -> float | None:
    """Time to first token: arrival → first output token, in seconds. ``None`` when no token came."""
    raise NotImplementedError


def itl_s(token_times_s: list[float]) -> list[float]:
    """Inter-token latencies: the gaps between consecutive tokens, in seconds (n − 1 of them for n tokens)."""
    raise NotImplementedError


def e2e_s(arrival_s: float, finish_s: float) -> float:
    """End-to-end latency: arrival → finish, in seconds."""
    raise NotImplementedError


def tpot_s(arrival_s: float, token_times_s: list[float], finish_s: float) -> float | None:
    """Time per output token *after the first*: (E2E − TTFT) / (n − 1), in seconds.

    ``None`` when there are fewer than two tokens: a one-token answer has no decode phase.
    """
    raise NotImplementedError


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) with linear interpolation between closest ranks.

    Sort the values; the q-th percentile sits at fractional position ``q / 100 × (n − 1)``; interpolate
    between the two values around it. Return ``math.nan`` for an empty list; raise ``ValueError`` when q is
    outside [0, 100]. Do not change the caller's list.
    """
    raise NotImplementedError


def meets_slo(request: dict, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Whether one request is *good*: status "ok", TTFT ≤ ttft_slo_s and TPOT ≤ tpot_slo_s.

    A request with no tokens is not good. A one-token request has no TPOT, so it cannot miss the TPOT target.
    """
    raise NotImplementedError


def attainment(requests: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Fraction of *all* requests (failed and cancelled included) that are good. ``math.nan`` for none."""
    raise NotImplementedError


def goodput_rps(requests: list[dict], ttft_slo_s: float, tpot_slo_s: float, window_s: float) -> float:
    """Good requests per second over a window of ``window_s`` seconds; 0.0 when the window is 0."""
    raise NotImplementedError

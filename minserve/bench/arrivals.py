"""When the load tester sends: open-loop timetables and the closed loop.

*Open loop* models users who arrive whether or not the server is keeping up. The send times are computed
before the run, from the rate and the seed alone, so a slow response can never delay the next request: that
is what avoids *coordinated omission* (a client that waits for answers quietly sends less load exactly
when the server is slow, and its percentiles hide the stall).

*Closed loop* models a fixed pool of ``concurrency`` users, each sending its next request when the last one
finished. It measures a server at a given load, not a service at a given demand.

Times are offsets in seconds from the start of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVALS: tuple[str, ...] = ("poisson", "gamma", "constant")


@dataclass(frozen=True)
class OpenLoop:
    """Requests at ``rate_rps`` on average; ``math.inf`` sends them all at once.

    ``process``: ``poisson`` (exponential gaps), ``gamma`` (gaps with shape ``burstiness`` and mean
    1/rate: below 1 is burstier than Poisson, above 1 more regular; 1 *is* Poisson) or ``constant``.
    """

    rate_rps: float
    process: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.process not in ARRIVALS:
            raise ValueError(f"arrival process must be one of {ARRIVALS}, got {self.process!r}")
        if not self.rate_rps > 0 or not self.burstiness > 0:
            raise ValueError(f"need rate > 0 and burstiness > 0, got {self.rate_rps!r}, {self.burstiness!r}")

    @property
    def label(self) -> str:
        return f"rate={self.rate_rps:g}"

    def timetable(self, num_requests: int) -> list[float]:
        """Intended send offsets in seconds, non-decreasing, the first at 0."""
        return timetable(num_requests, self.rate_rps, self.process, self.burstiness, self.seed)


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` requests in flight at all times (until the workload runs out)."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be ≥ 1, got {self.concurrency!r}")

    @property
    def label(self) -> str:
        return f"concurrency={self.concurrency}"


def inter_arrival_gaps(
    num_gaps: int, rate_rps: float, process: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """``num_gaps`` gaps between sends, in seconds, with mean 1/rate.

    Gamma(shape k, scale 1/(k·rate)) has mean 1/rate and coefficient of variation 1/√k; k = 1 is the
    exponential distribution, so Poisson is the gamma process with burstiness 1.
    """
    if math.isinf(rate_rps):
        return np.zeros(num_gaps)
    mean_s = 1.0 / rate_rps
    if process == "constant":
        return np.full(num_gaps, mean_s)
    shape = 1.0 if process == "poisson" else burstiness
    return np.random.default_rng(seed).gamma(shape, mean_s / shape, size=num_gaps)


def timetable(
    num_requests: int, rate_rps: float, process: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Intended send offsets in seconds for ``num_requests`` requests: 0, then the cumulative gaps."""
    if num_requests <= 0:
        return []
    gaps = inter_arrival_gaps(num_requests - 1, rate_rps, process, burstiness, seed)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_rates(text: str) -> list[float]:
    """``"1,2,4"`` → [1.0, 2.0, 4.0]; ``"inf"`` is allowed (everything at once)."""
    return [float(part) for part in text.split(",") if part.strip()]


def parse_concurrencies(text: str) -> list[int]:
    """``"1,4,16"`` → [1, 4, 16]."""
    return [int(part) for part in text.split(",") if part.strip()]

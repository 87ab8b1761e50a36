"""When the load tester sends: open-loop timetables and the closed loop.

*Open loop* models users who arrive whether or not the server is keeping up. The send times are computed
before the run, from the rate and the seed alone, so a slow response can never delay the next request: that
is what avoids *coordinated omission* (a client that waits for answers quietly sends less load exactly
when the server is slow, and its percentiles hide the stall).

*Closed loop* models a fixed pool of ``concurrency`` users, each sending its next request when the last one
finished. It measures a server at a given load, not a service at a given demand.

Times are offsets in seconds from the start of the run. The arrival processes themselves live in
:mod:`minserve.workload`, shared with the simulator, so a load test and a simulation of the same workload
send the same requests at the same times.
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.workload import ARRIVALS, parse_rates, timetable

__all__ = ["ARRIVALS", "ClosedLoop", "OpenLoop", "parse_concurrencies", "parse_rates", "timetable"]


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


def parse_concurrencies(text: str) -> list[int]:
    """``"1,4,16"`` → [1, 4, 16]."""
    return [int(part) for part in text.split(",") if part.strip()]

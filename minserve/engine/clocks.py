"""The engine core's two clocks: the wall clock it serves by, and the virtual clock the simulator moves.

The core reads time only through a :class:`Clock`, which is why the simulator can run the real core: a cost
model says how long each step took and moves a :class:`VirtualClock` forward by that much, and idle time
between arrivals is jumped over rather than slept through.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic clock, and a way to let idle time pass until ``time_s``."""

    def now(self) -> float: ...

    def wait_until(self, time_s: float) -> None: ...


class WallClock:
    """``time.perf_counter``: the clock an engine serves by. Waiting sleeps."""

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, time_s: float) -> None:
        time.sleep(max(0.0, time_s - time.perf_counter()))


class VirtualClock:
    """A clock that moves only when told: the simulator's. ``advance`` adds a step's cost; waiting jumps
    over idle time to the next arrival at once (never backwards)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.time_s = start_s

    def now(self) -> float:
        return self.time_s

    def advance(self, seconds: float) -> None:
        self.time_s += seconds

    def wait_until(self, time_s: float) -> None:
        self.time_s = max(self.time_s, time_s)

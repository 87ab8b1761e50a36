"""Is the engine core making progress? A watchdog in the front end that can tell.

A core that has died shows itself: its pipe closes, and the front end restarts it. A core that has *stopped*
does not: a kernel that never returns, a deadlock, a ``kill -STOP`` leave the process alive and the pipe
open, and without a watchdog ``/health`` would say ``ok`` while every request waits.

So the front end asks. Every ``PING_INTERVAL_S`` it pings the core, which answers between two steps (idle, at
once; busy, after the step in progress), and every message from the core counts as a sign of life. The core
is **stalled** when it has said nothing for longer than its bound: ``STALL_FACTOR`` × the longest of its
recent steps (its own measurement, sent with each pong), and never less than ``stall_timeout_s``, so that
one long prefill is not mistaken for a hang. While stalled, ``/health`` answers 503 (a load balancer takes
the replica out), ``/metrics`` says so, and new requests get 503 at once. Requests already in flight end at
their deadlines all the same: the front end keeps those itself (:mod:`minserve.engine.async_engine`).

A stalled core is not killed: the watchdog cannot tell a hang from a step slower than any before, and
killing the core would fail every request in it. It reports, and the core that resumes (``kill -CONT``) is
healthy again at its next message. A core that dies is restarted by the front end, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from minserve.engine.async_engine import AsyncLLMEngine

PING_INTERVAL_S = 0.25  # how often the core is asked for a sign of life
STALL_FACTOR = 10.0  # a live core's silence stays under this many of its slowest recent steps

logger = logging.getLogger(__name__)


class Watchdog:
    """Watches the engine core's signs of life; ``stalled`` says whether it has gone silent past its bound."""

    def __init__(self, engine: AsyncLLMEngine, stall_timeout_s: float, registry: CollectorRegistry) -> None:
        self.engine, self.stall_timeout_s = engine, stall_timeout_s
        self.stalled = False
        self._stalled_gauge = Gauge(
            "minserve:engine_stalled", "1 while the engine core makes no progress", registry=registry
        )
        self._silent_gauge = Gauge(
            "minserve:engine_silent_seconds", "Since the engine core last sent anything", registry=registry
        )
        self._bound_gauge = Gauge(
            "minserve:engine_stall_bound_seconds", "Silence past which the core counts as stalled", registry=registry
        )
        self._stalls = Counter("minserve:engine_stalls", "Times the engine core was found stalled", registry=registry)

    @property
    def bound_s(self) -> float:
        """How long the core may stay silent before it counts as stalled, seconds."""
        return max(self.stall_timeout_s, STALL_FACTOR * self.engine.longest_step_s)

    @property
    def silent_s(self) -> float:
        """Seconds since the core last sent anything."""
        return time.monotonic() - self.engine.last_heard_s

    def check(self) -> bool:
        """Judge the core now (logging a change once, not every check); returns ``stalled``."""
        silent_s, bound_s = self.silent_s, self.bound_s
        stalled = self.engine.health[0] == "ok" and silent_s > bound_s  # a restarting core is no stalled one
        if stalled and not self.stalled:
            self._stalls.inc()
            logger.error("the engine core (pid %s) has made no progress for %.1f s (bound %.1f s): /health says "
                         "503 until it does", self.engine.core_pid, silent_s, bound_s)  # fmt: skip
        elif self.stalled and not stalled:
            logger.warning("the engine core is making progress again")
        self.stalled = stalled
        self._stalled_gauge.set(int(stalled))
        self._silent_gauge.set(silent_s)
        self._bound_gauge.set(bound_s)
        return stalled

    async def run(self) -> None:
        """Ping and judge, until cancelled."""
        while True:
            self.engine.ping()
            await asyncio.sleep(min(PING_INTERVAL_S, self.stall_timeout_s / 4))
            self.check()

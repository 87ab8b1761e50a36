"""The server's end: on SIGTERM, drain for at most ``shutdown_drain_s``, then exit, whatever still runs.

uvicorn, told to exit, first closes its listening socket and then waits for every open connection to finish
*before* the app's shutdown runs: a request stuck in a stopped engine core would hold the process forever,
and ``/health`` could never say ``draining``, for nobody could reach it. So the first SIGTERM (or Ctrl-C)
does not tell uvicorn at all. It starts the drain: ``/health`` answers 503 ``draining`` (a load balancer
takes the replica out), new requests get 503, running ones may finish. uvicorn is told to exit once none
runs, or once ``shutdown_drain_s`` has passed; then what still runs is ended with a 503 (an error event in a
stream), so every connection closes promptly, and the engine core, stopped or not, is stopped after it. A
second signal skips the drain (uvicorn's own handling).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from minserve.engine.async_engine import AsyncLLMEngine

SHUTDOWN_MESSAGE = "the server is shutting down and its drain time is up; retry on another replica"

logger = logging.getLogger(__name__)


class Lifetime:
    """Whether the server drains, and until when (``time.monotonic`` seconds)."""

    def __init__(self, engine: AsyncLLMEngine, drain_s: float) -> None:
        self.engine, self.drain_s = engine, drain_s
        self.draining = False
        self.deadline_s = float("inf")

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining, self.deadline_s = True, time.monotonic() + self.drain_s
            logger.warning("shutting down: draining %d running requests for at most %g s",
                           self.engine.num_in_flight, self.drain_s)  # fmt: skip

    @property
    def remaining_s(self) -> float:
        """Seconds of the drain left (0 when it is over)."""
        return max(0.0, self.deadline_s - time.monotonic())

    def drained(self) -> bool:
        """True once nothing runs, or once the drain time is up: then what still runs is ended now."""
        if self.engine.num_in_flight == 0:
            return True
        if self.remaining_s > 0:
            return False
        logger.error("drain time up: ending %d requests still running", self.engine.num_in_flight)
        self.engine.fail_all(SHUTDOWN_MESSAGE)
        return True

    async def drain(self) -> None:
        """Drain (if no signal began it, begin now) until :meth:`drained`."""
        self.begin_drain()
        while not self.drained():
            await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or SIGINT before it exits (see the module's doc).
    ``on_ready`` is called once it listens."""

    def __init__(self, config: uvicorn.Config, lifetime: Lifetime, on_ready=None) -> None:
        super().__init__(config)
        self.lifetime, self.on_ready = lifetime, on_ready

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifetime.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised on exit: a service manager sees the signal it sent
        self.lifetime.begin_drain()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    async def on_tick(self, counter: int) -> bool:
        if self.lifetime.draining and self.lifetime.drained():
            self.should_exit = True
        return await super().on_tick(counter)

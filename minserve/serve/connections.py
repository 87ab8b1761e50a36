"""Connections: how many the server holds, and how long one may sit without sending a request.

Every open connection costs a file descriptor, and a process has a fixed number of them. Without a bound, a
client that opens ten thousand connections and sends nothing exhausts them: ``accept`` then fails with
``EMFILE``, ``/health`` cannot get in, and each failed accept logs a traceback. uvicorn's own limits do not
help here: ``limit_concurrency`` answers 503 to *requests* past the limit (a silent connection sends none,
and its descriptor is held all the same), and ``timeout_keep_alive`` starts only after a first response.

So the server's HTTP protocol (uvicorn's h11 one, with three hooks) keeps a ledger of its connections:

* **idle** connections, those with no request in the app (just opened, headers still arriving, or kept
  alive after a response), oldest first; one idle for ``connection_idle_timeout_s`` is closed. That bounds
  a silent client and a slow-header one (slowloris) alike; h11 bounds the headers' size.
* **at most** ``max_connections`` open: a new connection past the limit takes the place of the longest-idle
  one, so a flood of silent connections can never lock a real client (or a health check) out. Only when
  every connection is busy with a request is the newcomer closed at once. The limit is kept below the
  process's descriptor limit, so ``accept`` never fails.

Refusals and closures are counted in ``/metrics`` and logged once a minute at most, never once per accept.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.h11_impl import H11Protocol

RESERVED_FDS = 128  # descriptors kept for everything but client connections: model files, pipes, logs
LOG_EVERY_S = 60.0  # at most one summary line about refused or closed connections a minute

logger = logging.getLogger(__name__)


class ConnectionLedger:
    """The server's open connections: which are idle since when, and the limit on how many are open."""

    def __init__(self, max_connections: int, idle_timeout_s: float, registry: CollectorRegistry) -> None:
        self.max_connections = min(max_connections, usable_fds())
        if self.max_connections < max_connections:
            logger.warning("max_connections lowered from %d to %d: the process may open only %d files",
                           max_connections, self.max_connections, fd_limit())  # fmt: skip
        self.idle_timeout_s = idle_timeout_s
        self.open: set[asyncio.Protocol] = set()
        self.idle: OrderedDict[asyncio.Protocol, float] = OrderedDict()  # protocol → idle since, oldest first
        self._sweeper: asyncio.Task | None = None
        self._unlogged = 0
        self._logged_at_s = -LOG_EVERY_S
        self.open_gauge = Gauge("minserve:http_connections", "Open HTTP connections", registry=registry)
        self.closed = Counter("minserve:http_connections_closed", "Connections the server closed, by why",
                              ["reason"], registry=registry)  # fmt: skip

    def opened(self, connection: H11Protocol) -> bool:
        """A new connection: make room for it (closing the longest-idle one); False if it must be closed."""
        if len(self.open) >= self.max_connections:
            if not self.idle:
                self._closing("refused", "every connection is busy with a request")
                return False
            self._closing("evicted", "the longest-idle connection was closed to make room")
            self._drop(next(iter(self.idle)))
        self.open.add(connection)
        self.became_idle(connection)
        self.open_gauge.set(len(self.open))
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return True

    def became_idle(self, connection: H11Protocol) -> None:
        self.idle[connection] = time.monotonic()
        self.idle.move_to_end(connection)

    def became_busy(self, connection: H11Protocol) -> None:
        self.idle.pop(connection, None)

    def lost(self, connection: H11Protocol) -> None:
        self.open.discard(connection)
        self.idle.pop(connection, None)
        self.open_gauge.set(len(self.open))

    async def _sweep(self) -> None:
        """Close connections idle past the timeout, oldest first, while any connection is open."""
        while self.open:
            await asyncio.sleep(min(1.0, self.idle_timeout_s / 4))
            cutoff_s = time.monotonic() - self.idle_timeout_s
            while self.idle and next(iter(self.idle.values())) < cutoff_s:
                self.closed.labels(reason="idle").inc()
                self._drop(next(iter(self.idle)))

    def _drop(self, connection: H11Protocol) -> None:
        """Close a connection and forget it now (its ``connection_lost`` comes a loop iteration later)."""
        self.lost(connection)
        _close(connection)

    def _closing(self, reason: str, why: str) -> None:
        """Count a refusal or an eviction; log the first, then a summary a minute at most."""
        self.closed.labels(reason=reason).inc()
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at_s >= LOG_EVERY_S:
            logger.warning("connection limit (%d) reached: %s (%d such closures since the last line; "
                           "/metrics counts them)", self.max_connections, why, self._unlogged)  # fmt: skip
            self._unlogged, self._logged_at_s = 0, now


def protocol_class(ledger: ConnectionLedger) -> type[H11Protocol]:
    """uvicorn's h11 protocol, reporting to ``ledger`` when a connection opens, starts a request, answers it
    and closes: pass it as uvicorn's ``http``."""

    class LedgeredH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not ledger.opened(self):
                _close(self)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                ledger.became_busy(self)  # the headers are in: the request is the app's, however long

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                ledger.became_idle(self)

        def connection_lost(self, exc: Exception | None) -> None:
            ledger.lost(self)
            super().connection_lost(exc)

    return LedgeredH11Protocol


def _close(connection: H11Protocol) -> None:
    """Drop a connection now: ``abort`` frees its descriptor at once, with no lingering close."""
    connection.transport.abort()


def fd_limit() -> int:
    """The process's file descriptor limit, after raising the soft limit to the hard one (as servers do)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def usable_fds() -> int:
    """How many connections the descriptor limit leaves room for."""
    return max(1, fd_limit() - RESERVED_FDS)


class OncePerMinute(logging.Filter):
    """Lets a repeated log record through once a minute: asyncio logs every failed ``accept`` (``EMFILE``)."""

    def __init__(self) -> None:
        super().__init__()
        self._last_s = -LOG_EVERY_S

    def filter(self, record: logging.LogRecord) -> bool:
        if "accept" not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self._last_s < LOG_EVERY_S:
            return False
        self._last_s = now
        return True

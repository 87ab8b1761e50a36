"""The HTTP server's settings: its address, its limits, and what it does under overload and on shutdown."""

from __future__ import annotations

import math
from dataclasses import dataclass

from minserve.config.options import check_whole, option

MAX_PORT = 65535


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's limits. Times in seconds, sizes in bytes.

    ``admission`` decides which requests are refused at once with 429 (:mod:`minserve.admission`):
    ``"queue-length"`` (past ``max_waiting_requests`` waiting), ``"token-budget"`` (past
    ``max_queued_prompt_tokens`` prompt tokens queued) or ``"deadline"`` (a predicted time to first token
    over ``admission_headroom`` × ``ttft_slo_ms``, or × the request's shorter timeout); the last two keep the
    queue-length limit too. Or an :class:`~minserve.admission.AdmissionPolicy` object, the whole
    policy (chapter 09's exercise). A 429's ``Retry-After`` is predicted from the queue, at least ``retry_after_s``.
    A request running longer than ``request_timeout_s``, or than the timeout it sends itself (body
    ``timeout`` or header ``X-Request-Timeout``, seconds, capped by ``request_timeout_s``), is stopped (504).
    Degraded modes (:mod:`minserve.serve.degrade`) turn on when ``degrade_enter_requests`` requests are in
    the server and off when no more than ``degrade_exit_requests`` (default: half as many) remain: a
    ``degraded_max_tokens`` cap, a shorter context ``degraded_max_model_len`` (longer prompts get 429), and
    with ``degraded_no_speculation`` speculative decoding off. A chat request that sends no
    ``max_tokens`` gets ``default_max_tokens`` (or what is left of the context, if less); a completion
    request gets 16, as OpenAI's API does. A request body over ``max_body_bytes`` is refused (413) while it
    is being read, whatever its framing. On shutdown, running requests get up to ``shutdown_drain_s`` to
    finish; past that they are ended (503) and the server exits. ``api_key``, when set, is required on every
    route but /health. The server holds at most ``max_connections`` connections (at the limit a new one
    takes the place of the longest-idle one) and closes one that sends no complete request for
    ``connection_idle_timeout_s`` (:mod:`minserve.serve.connections`). An engine core silent for longer than
    ``stall_timeout_s`` (or ten of its slowest recent steps) is reported stalled (:mod:`minserve.serve.watchdog`).
    ``trace_out``: a file to write the engine's trace to (Chrome/Perfetto JSON) when the server stops.
    """

    host: str = option("127.0.0.1", "address to bind; 127.0.0.1 is loopback only")
    port: int = option(8000, "TCP port")
    api_key: str | None = option(None, "require this bearer token (or set MINSERVE_API_KEY)")
    # A name, or an AdmissionPolicy object (chapter 09's exercise plugs one in). Checked when the server
    # starts, by minserve.admission.make_admission (the simulator runs the same policies).
    admission: str | object = option("queue-length", "which requests get 429 at once: queue-length, "
                                     "token-budget or deadline")  # fmt: skip
    max_waiting_requests: int = option(256, "past this queue length: 429 (under every --admission)")
    max_queued_prompt_tokens: int = option(32768, "--admission token-budget: past this many queued prompt tokens: 429")
    ttft_slo_ms: float = option(1000.0, "--admission deadline: 429 when the predicted TTFT is over this, ms")
    # Why not 1: admitted at a prediction equal to the SLO, the actual TTFTs scatter around it and about half
    # miss (measured in the simulator and on the server; chapter 09).
    admission_headroom: float = option(0.5, "--admission deadline: admit while the predicted TTFT is within this "
                                       "share of the TTFT SLO (or of a shorter timeout of its own)")  # fmt: skip
    request_timeout_s: float = option(600.0, "a request running longer is cancelled (504)")
    default_max_tokens: int = option(512, "a chat request's max_tokens when it sends none")
    retry_after_s: int = option(1, "the Retry-After of a 503, and the least of a 429's, seconds")
    degrade_enter_requests: int | None = option(None, "degraded modes on at this many requests in the server")
    degrade_exit_requests: int | None = option(None, "… and off again at this many (default: half as many)")
    degraded_max_tokens: int | None = option(None, "degraded: cap each request's max_tokens at this")
    degraded_max_model_len: int | None = option(None, "degraded: a shorter context, tokens (longer prompts: 429)")
    degraded_no_speculation: bool = option(False, "degraded: speculative decoding off")
    max_body_bytes: int = option(4 * 2**20, "largest request body, bytes (413 past it)")
    shutdown_drain_s: float = option(30.0, "on SIGTERM, how long running requests may finish before they are ended")
    max_connections: int = option(1024, "most open connections; past it the longest-idle one is closed")
    connection_idle_timeout_s: float = option(10.0, "close a connection that sends no complete request for this long")
    stall_timeout_s: float = option(30.0, "an engine core silent this long (at least) is reported stalled (503)")
    trace_out: str | None = option(None, "on exit, write the engine's trace here (Perfetto JSON)")

    def __post_init__(self) -> None:
        check_whole(self, "port", self.port, minimum=0)
        if self.port > MAX_PORT:
            raise ValueError(f"ServerConfig.port must be at most {MAX_PORT} (0: any free port), got {self.port}")
        check_whole(self, "max_connections", self.max_connections)
        for name in ("shutdown_drain_s", "connection_idle_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ServerConfig.{name} must be a positive number of seconds, got {value!r}")
        check_whole(self, "max_waiting_requests", self.max_waiting_requests, minimum=0)
        check_whole(self, "max_body_bytes", self.max_body_bytes)
        check_whole(self, "default_max_tokens", self.default_max_tokens)
        if not self.request_timeout_s > 0:
            raise ValueError(f"ServerConfig.request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        check_whole(self, "max_queued_prompt_tokens", self.max_queued_prompt_tokens)
        if not self.ttft_slo_ms > 0:
            raise ValueError(f"ServerConfig.ttft_slo_ms must be > 0, got {self.ttft_slo_ms!r}")
        if not 0 < self.admission_headroom <= 1:
            raise ValueError(f"ServerConfig.admission_headroom must be in (0, 1], got {self.admission_headroom!r}: "
                             "the share of the TTFT budget a predicted TTFT may use")  # fmt: skip
        check_whole(self, "degrade_enter_requests", self.degrade_enter_requests, optional=True)
        check_whole(self, "degrade_exit_requests", self.degrade_exit_requests, minimum=0, optional=True)

"""A router in front of several ``minserve serve`` replicas: data parallelism over HTTP (chapter 06).

    minserve route --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --policy prefix-aware
    minserve route --replicas 2 --model minserve-tiny --threads 1      # starts the two replicas itself

Clients talk to the router as to one server: ``/v1/completions``, ``/v1/chat/completions`` (streamed or
not), ``/v1/models``, ``/health`` and ``/metrics``. Each request goes, unchanged, to the replica the policy
(:mod:`~minserve.serve.routing`) chooses among the healthy ones, and the answer comes back unchanged: a
stream is passed on chunk by chunk as the replica sends it, never buffered. The router does not parse
requests beyond reading their prompt for the prefix-aware policy; checking them is the replicas' job, so
a bad request gets the replica's own 400, and an API key is theirs to check too (the router passes the
``Authorization`` header on).

**Health.** A background task asks every replica's ``/health`` each ``health_interval_s``. A replica that
fails ``unhealthy_after`` checks in a row, or refuses a connection (to a check or to a request), is taken
out; it comes back when it answers ``ok`` again. ``/health`` is ok while at least one replica is.

**Failover.** A request whose forward fails before any byte of the answer reached the client (connection
refused or reset, or a 502/503 from the replica) is sent to another healthy replica, up to ``max_retries``
times; each retry is counted in ``/metrics``. Generating has no side effect but compute, and a replica
cancels a request whose connection dropped, so resending one that never answered is safe. A stream that
has started is never resent (see :func:`_relay`). With no healthy replica the answer is 503 with
``Retry-After``, in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from minserve.serve.protocol import error_body
from minserve.serve.responses import sse_event
from minserve.serve.routing import Replica, RouterConfig, make_routing_policy

logger = logging.getLogger(__name__)

RETRYABLE_STATUSES = (502, 503)  # the replica could not take it (restarting, draining); 429 is backpressure
CONNECT_TIMEOUT_S = 5.0
REPLICA_HEADER = "x-minserve-replica"  # on every forwarded answer: which replica gave it
# Headers about one connection (RFC 9110 §7.6.1), and those the router's own server sets.
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                  "proxy-connection", "host", "content-length", "date", "server"}  # fmt: skip


class RouterMetrics:
    """Prometheus metrics under ``minserve_router:``; the per-replica gauges are read at scrape time."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "minserve_router:requests", "Forwards to each replica (a retry counts again)", ["replica"], registry=r
        )
        self.retries = Counter(
            "minserve_router:retries", "Requests resent elsewhere, by the replica that failed", ["replica"], registry=r
        )
        self.stream_failures = Counter(
            "minserve_router:stream_failures", "Streams cut by their replica after they began", ["replica"], registry=r
        )
        self.unavailable = Counter("minserve_router:requests_unavailable", "503s: no healthy replica", registry=r)
        self.in_flight = Gauge("minserve_router:requests_in_flight", "Forwarded, not answered", ["replica"], registry=r)
        self.healthy = Gauge(
            "minserve_router:replica_healthy", "1 while a replica takes requests", ["replica"], registry=r
        )
        for url in urls:  # every replica's series from the start, at zero, so a rate over them is defined
            for counter in (self.requests, self.retries, self.stream_failures):
                counter.labels(replica=url)

    def render(self, replicas: Sequence[Replica]) -> bytes:
        for replica in replicas:
            self.in_flight.labels(replica=replica.url).set(replica.in_flight)
            self.healthy.labels(replica=replica.url).set(int(replica.healthy))
        return generate_latest(self.registry)


@dataclass
class _Failed:
    """A forward that failed before the client got anything. ``answer``: the replica's own (a 503), if any."""

    answer: Response | None = None


class Router:
    """The replicas, the policy and one HTTP client: choose, forward, fail over, check health."""

    def __init__(self, urls: Sequence[str], config: RouterConfig) -> None:
        _check_urls(urls)
        self.config = config
        self.replicas = [Replica(url.rstrip("/"), config.unhealthy_after) for url in urls]
        self.policy = make_routing_policy(config.policy, config.prefix_chars, config.max_imbalance)
        self.metrics = RouterMetrics([replica.url for replica in self.replicas])
        # No pool limit: a capped pool would queue requests inside the router, out of every policy's sight.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(config.request_timeout_s, connect=CONNECT_TIMEOUT_S)
        self.http = httpx.AsyncClient(limits=limits, timeout=timeout)

    def healthy(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.healthy]

    # --- health ------------------------------------------------------------------------------------------

    async def check_health(self) -> None:
        """Ask every replica's ``/health`` once, all at the same time."""
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))

    async def _check(self, replica: Replica) -> None:
        was_healthy, refused = replica.healthy, False
        try:
            response = await self.http.get(replica.url + "/health", timeout=self.config.health_timeout_s)
            ok = response.status_code == 200 and response.json().get("status") == "ok"  # not "draining"
        except httpx.ConnectError:
            ok, refused = False, True
        except (httpx.HTTPError, ValueError, AttributeError):  # a timeout, or an answer that is no health
            ok = False
        if ok:
            replica.passed_check()
        else:
            replica.failed_check(refused)
        if replica.healthy != was_healthy:
            logger.warning("replica %s is %s", replica.url, "back" if replica.healthy else "out")

    async def keep_checking(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    # --- forwarding --------------------------------------------------------------------------------------

    async def forward(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send a request to the policy's replica; on a failure before any byte, to another (``max_retries``)."""
        parsed = _json_object(body)
        tried: list[Replica] = []
        failure = _Failed()
        for _ in range(1 + self.config.max_retries):
            candidates = [replica for replica in self.healthy() if replica not in tried]
            if not candidates:
                break
            replica = self.policy.choose(candidates, parsed)
            replica.in_flight += 1  # no await since choose: the next request's choice sees this one
            if tried:
                self.metrics.retries.labels(replica=tried[-1].url).inc()
            tried.append(replica)
            outcome = await self._attempt(replica, path, body, headers)
            if not isinstance(outcome, _Failed):
                return outcome
            failure = outcome
        if failure.answer is not None:  # every replica tried said 503: pass the last one's answer on
            return failure.answer
        return self.unavailable()

    async def _attempt(self, replica: Replica, path: str, body: bytes, headers: dict[str, str]) -> Response | _Failed:
        """One forward. Holds ``replica.in_flight`` (taken by the caller) until the answer is sent or fails."""
        self.metrics.requests.labels(replica=replica.url).inc()
        committed = False
        upstream = None
        try:
            request = self.http.build_request("POST", replica.url + path, content=body, headers=headers)
            upstream = await self.http.send(request, stream=True)
            answer_headers = {**_forwardable(upstream.headers), REPLICA_HEADER: replica.url}
            if upstream.status_code in RETRYABLE_STATUSES:
                content = await upstream.aread()
                return _Failed(Response(content, upstream.status_code, answer_headers))
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                # A whole body: the replica sends nothing until it has finished, so a replica that dies
                # while generating fails here, before the client has a byte, and the request can go elsewhere.
                return Response(await upstream.aread(), upstream.status_code, answer_headers)
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")  # wait for the first event: a stream failing before it is retryable
            committed = True  # from here on the answer releases the replica when it ends, however it ends
            relay = _relay(first, chunks, on_failure=lambda: self._stream_failed(replica))
            release = lambda: self._release(replica, upstream)  # noqa: E731
            return _RelayedStream(relay, upstream.status_code, answer_headers, on_close=release)
        except httpx.TimeoutException as error:
            if isinstance(error, httpx.ConnectTimeout):
                replica.failed_check()
                return _Failed()
            # It took the request and went quiet past the timeout: resending would double the wait.
            return _error(504, f"the replica did not answer within {self.config.request_timeout_s} s", "timeout")
        except httpx.TransportError as error:  # refused, reset, or closed mid-answer: nothing was sent on
            logger.warning("forward to %s failed: %r", replica.url, error)
            replica.failed_check(refused=isinstance(error, httpx.ConnectError))
            return _Failed()
        finally:
            if not committed:  # a stream's answer releases these when it ends
                await self._release(replica, upstream)

    async def _release(self, replica: Replica, upstream: httpx.Response | None) -> None:
        replica.in_flight -= 1
        if upstream is not None:
            await upstream.aclose()  # closing mid-stream drops the connection: the replica cancels the request

    def _stream_failed(self, replica: Replica) -> None:
        self.metrics.stream_failures.labels(replica=replica.url).inc()
        replica.failed_check()

    async def models(self) -> Response:
        """``/v1/models`` from the first healthy replica that answers."""
        for replica in self.healthy():
            with contextlib.suppress(httpx.HTTPError):
                response = await self.http.get(replica.url + "/v1/models", timeout=self.config.health_timeout_s)
                if response.status_code == 200:
                    return Response(
                        response.content, 200, {**_forwardable(response.headers), REPLICA_HEADER: replica.url}
                    )
        return self.unavailable()

    def unavailable(self) -> JSONResponse:
        self.metrics.unavailable.inc()
        healthy = len(self.healthy())
        message = f"no replica could take the request ({healthy} of {len(self.replicas)} healthy); retry later"
        headers = {"Retry-After": str(self.config.retry_after_s)}
        return _error(503, message, "no_healthy_replica", headers)

    async def aclose(self) -> None:
        await self.http.aclose()


async def _relay(first: bytes, chunks: AsyncIterator[bytes], on_failure: Callable[[], None]) -> AsyncIterator[bytes]:
    """The replica's stream, chunk by chunk as it arrives.

    A stream that breaks after it began is never resent: the client holds tokens already, and a second
    replica would start the answer again from its first token (and, sampling, say something else). It
    ends with an error event instead, as a replica's own stream does when a request fails, so the client
    sees a failure rather than an answer cut short without a word. The blank line first ends whatever
    event the replica left half sent.
    """
    yield first
    try:
        async for chunk in chunks:
            yield chunk
    except httpx.TransportError:
        on_failure()
        failed = error_body("the replica serving this stream failed", code="replica_failed", kind="server_error")
        yield "\n\n" + sse_event(failed)


class _RelayedStream(StreamingResponse):
    """A streaming answer that runs ``on_close`` however it ends: finished, failed, or the client gone,
    even before the first chunk (when the body's own ``finally`` would never run)."""

    def __init__(self, content: AsyncIterator[bytes], status: int, headers: dict, on_close: Callable) -> None:
        super().__init__(content, status, headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def create_router_app(urls: Sequence[str], config: RouterConfig | None = None) -> FastAPI:
    """The router's app over the replicas at ``urls`` (base URLs, without ``/v1``)."""
    config = config or RouterConfig()
    router = Router(urls, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.check_health()  # serve from the first request on what is known, not on a guess
        checking = asyncio.create_task(router.keep_checking())
        yield
        checking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checking
        await router.aclose()

    app = FastAPI(title="minserve router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):  # 404, 405: OpenAI's shape too
        return _error(error.status_code, str(error.detail), f"http_{error.status_code}", error.headers)

    @app.get("/health")
    async def health():
        replicas = [replica.describe() for replica in router.replicas]
        if not router.healthy():
            return JSONResponse({"status": "no_healthy_replica", "replicas": replicas}, status_code=503)
        return {"status": "ok", "replicas": replicas}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(router.metrics.render(router.replicas), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return await router.models()

    async def forwarded(request: Request) -> Response:
        body = await _read_body(request, config.max_body_bytes)
        if body is None:
            return _error(413, f"request body over {config.max_body_bytes} bytes", "body_too_large")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        return await router.forward(request.url.path, body, headers)

    app.add_api_route("/v1/completions", forwarded, methods=["POST"])
    app.add_api_route("/v1/chat/completions", forwarded, methods=["POST"])
    return app


async def _read_body(request: Request, limit_bytes: int) -> bytes | None:
    """The whole body, or ``None`` as soon as it passes ``limit_bytes`` (the rest is never read)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(body: bytes) -> dict:
    """The body as a JSON object for the policy, or ``{}`` (the replica will say what is wrong with it)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _forwardable(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _NOT_FORWARDED}


def _error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    """An answer of the router's own, typed as the server types its errors."""
    kind = "service_unavailable" if status == 503 else "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, code=code, kind=kind), status, headers=headers)


def _check_urls(urls: Sequence[str]) -> None:
    if not urls:
        raise ValueError("the router needs at least one replica: --replica URL (repeatable) or --replicas N")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a replica is a base URL such as http://127.0.0.1:8001 (without /v1), got {url!r}")
    if len({url.rstrip("/") for url in urls}) != len(urls):
        raise ValueError(f"a replica is named twice in {list(urls)}")


def route(urls: Sequence[str], config: RouterConfig, log_level: str = "info") -> None:
    """Route until interrupted (Ctrl-C or SIGTERM)."""
    from minserve.serve.server import configure_logging

    app = create_router_app(urls, config)  # bad replica URLs fail here, before anything is set up
    configure_logging(log_level)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level)


__all__ = ["REPLICA_HEADER", "Router", "create_router_app", "route"]

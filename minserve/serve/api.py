"""An OpenAI-compatible HTTP server over the engine: completions, chat completions, models, health, metrics.

    minserve serve --model minserve-tiny --port 8000
    curl localhost:8000/v1/completions -d '{"model": "minserve-tiny", "prompt": "def fib(n):", "max_tokens": 32}'

No request can stop the server. Every request is checked before it reaches the engine and refused with an
OpenAI-style 4xx body naming the field (:mod:`~minserve.serve.protocol`); the key and the body's size are
checked before it is even parsed (:mod:`~minserve.serve.guard`). Tokenizing runs in a worker thread, so a
long prompt never holds the event loop. Admission is a policy (:mod:`~minserve.admission`): a request
it refuses gets 429 at once, with a Retry-After predicted from the queue, and its decision is exact under any
concurrency because the server reads the queue, decides and joins it in one synchronous stretch, no
``await`` between. Under heavy load, degraded modes (:mod:`~minserve.serve.degrade`) cap what each request
gets. A failure inside one request ends that request alone (a 500, or an error event in a stream); a core
that dies is restarted by the engine's front end. A client that disconnects mid-stream cancels its request,
freeing its KV blocks. A request's deadline (the server's ``request_timeout_s``, or the shorter timeout the
request sends) travels with it to the engine core, which stops it wherever it is. Clients never see a
traceback: those go to the server's log. On shutdown, running requests are drained first, for a bounded
time (:mod:`~minserve.serve.lifetime`). The server's lifetime has guards of its own: a bounded number of
connections, idle ones closed (:mod:`~minserve.serve.connections`), and a watchdog on the engine core
(:mod:`~minserve.serve.watchdog`); a request's deadline holds even when the core stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minserve.admission import QueueState, Refusal, RequestFacts, make_admission, queue_limit, retry_after_header
from minserve.config import ServerConfig
from minserve.engine.async_engine import SHUTDOWN_TIMEOUT_S, AsyncLLMEngine, EngineDeadError
from minserve.engine.input_processor import EngineInput
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import MIN_TIMEOUT_S, SamplingParams
from minserve.serve import degrade
from minserve.serve.connections import ConnectionLedger
from minserve.serve.guard import RequestGuard
from minserve.serve.info import server_info
from minserve.serve.lifetime import Lifetime
from minserve.serve.metrics import ServerMetrics
from minserve.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    SamplingFields,
    error_body,
)
from minserve.serve.responses import CHAT, COMPLETION, Reply, sse_event
from minserve.serve.watchdog import Watchdog

logger = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds, as the body's `timeout`

_ERRORS = {
    400: "invalid request: the message names the field",
    401: "missing or invalid API key",
    404: "the model is not served here",
    413: "request body too large",
    429: "refused by admission control (the code says why): retry after Retry-After seconds",
    500: "the request failed inside the engine",
    503: "the engine is restarting or stalled, or the server is shutting down",
    504: "the request ran past its timeout (the server's, or its own: body timeout, header X-Request-Timeout)",
}
_GENERATION_RESPONSES = {status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}


class ApiError(Exception):
    """An OpenAI-style error answer. ``admitted``: the request had reached the engine (a timeout, say)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        admitted: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.admitted = status, message, param, code, admitted
        self.headers = headers


def create_app(engine: AsyncLLMEngine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """The app over ``engine``. ``config.admission`` may be a policy object: chapter 09's exercise plugs its
    own admission controller in there."""
    config = config or ServerConfig()
    admission = make_admission(config)
    full_queue = queue_limit(config)
    degrader = degrade.make_degrader(config, engine.set_speculation)
    metrics = ServerMetrics()
    engine.on_finished = metrics.observe_finished  # every finished request, cancelled and failed ones included
    lifetime = Lifetime(engine, config.shutdown_drain_s)
    watchdog = Watchdog(engine, config.stall_timeout_s, metrics.registry)
    connections = ConnectionLedger(config.max_connections, config.connection_idle_timeout_s, metrics.registry)

    def observe_load() -> tuple[QueueState, bool]:
        """Read the load now: the degraded modes' switch and the load gauges follow it. Returns the load read
        and whether the modes are on."""
        queue = QueueState.of(engine)
        degraded = degrader is not None and degrader.observe(queue)
        metrics.observe_load(queue, degraded)
        return queue, degraded

    async def watch_load() -> None:
        # Admissions and scrapes read the load too, but a server whose load has fallen may see neither for a
        # while: without this, it would stay degraded (speculation off) until the next request.
        while True:
            await asyncio.sleep(degrade.WATCH_INTERVAL_S)
            observe_load()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watchers = [asyncio.create_task(watchdog.run())]
        if degrader is not None:
            watchers.append(asyncio.create_task(watch_load()))
        yield
        for watcher in watchers:
            watcher.cancel()
        await lifetime.drain()  # refuse new work, let what runs finish (done already after a SIGTERM)
        # A core gets its usual time to stop, unless the drain used it all: then the bound is what counts.
        engine.shutdown(trace_out=config.trace_out, timeout_s=min(SHUTDOWN_TIMEOUT_S, max(1.0, lifetime.remaining_s)))

    app = FastAPI(title="minserve", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.degrader = engine, metrics, degrader
    app.state.lifetime, app.state.watchdog, app.state.connections = lifetime, watchdog, connections
    app.state.info = server_info(engine, model_name, config)

    def refuse(
        status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ) -> JSONResponse:
        """An error answer for a request that never reached the engine, counted by reason."""
        metrics.requests_rejected.labels(reason=code or "invalid").inc()
        if status in (429, 503):  # a Retry-After given (an admission refusal's prediction) wins
            headers = {"Retry-After": str(config.retry_after_s), **(headers or {})}
        return _error(status, message, param, code, headers)

    app.add_middleware(RequestGuard, config=config, refuse=refuse)
    _install_error_handlers(app, refuse)
    app.openapi = lambda: _openapi(app)

    @app.get("/health", responses={503: {"description": "the engine is not serving", "model": dict}})
    async def health():
        status, reason = engine.health
        if lifetime.draining:  # a load balancer takes the replica out while it drains
            return JSONResponse({"status": "draining", "drain_left_s": round(lifetime.remaining_s, 1)}, 503)
        if status == "ok" and watchdog.check():
            status, reason = "stalled", f"no progress for {watchdog.silent_s:.1f} s (bound {watchdog.bound_s:.1f} s)"
        if status != "ok":  # a load balancer takes the replica out until the core is back
            return JSONResponse({"status": f"engine_{status}", "reason": reason}, status_code=503)
        return {"status": "ok", "engine_restarts": engine.num_restarts}

    @app.head("/health", include_in_schema=False)  # load balancers send HEAD: the same status, no body
    async def health_head():
        return await health()

    @app.get("/v1/models")
    async def models():
        entry = {"id": model_name, "object": "model", "owned_by": "minserve", "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [{**entry, "minserve": app.state.info}]}

    @app.get("/info")
    async def info():
        """The model, its cache and batch limits, the admission policy: what the startup line says."""
        return app.state.info

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        observe_load()
        watchdog.check()
        text = metrics.render(engine.stats(), engine.num_restarts)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", response_model=None, responses=_documented(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        reply = Reply("", COMPLETION, model_name, engine.tokenizer, logprobs=body.logprobs is not None)
        params = _params(body, body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs)
        return await _run(body, request, reply, params, lambda: _completion_prompt(body.prompt))

    @app.post("/v1/chat/completions", response_model=None, responses=_documented(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        reply = Reply("", CHAT, model_name, engine.tokenizer, logprobs=body.logprobs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(body, max_tokens or config.default_max_tokens, top)
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        fills_context = max_tokens is None  # the default shrinks to what the context leaves; a request's own does not
        tools = body.template_tools()
        return await _run(body, request, reply, params, lambda: _chat_prompt(messages, tools), fills_context)

    def _completion_prompt(prompt: str | list[int]) -> tuple[str | list[int], list[int]]:
        # A client's text is text: control tokens come only as token ids.
        return prompt, _refuse_invalid(lambda: engine.inputs.encode(prompt, parse_special=False))

    def _chat_prompt(messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        try:
            return engine.inputs.encode_chat(messages, tools)
        except ValueError as error:
            param = _param_of(error) if str(error).startswith(("messages", "tools")) else "messages"
            raise ApiError(400, str(error), param=param) from error

    async def _run(
        body: SamplingFields,
        request: Request,
        reply: Reply,
        params: SamplingParams,
        render: Callable[[], tuple[str | list[int], list[int]]],
        fills_context: bool = False,
    ):
        """Admit the request (or refuse it), then answer: one body, or a stream of events."""
        arrival_s = time.perf_counter()
        if lifetime.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if watchdog.stalled:
            raise ApiError(503, "the engine core is making no progress; retry on another replica",
                           code="engine_stalled")  # fmt: skip
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        own_timeout_s = _own_timeout_s(body.timeout, request.headers.get(TIMEOUT_HEADER), config.request_timeout_s)
        timeout_s = own_timeout_s or config.request_timeout_s
        if full_queue is not None:  # a full queue refuses before the tokenizer's work; _admit decides exactly
            _raise_if_refused(full_queue.refuse_full(QueueState.of(engine)))  # a read: _admit observes the load
        prompt, ids = await _off_the_loop(render)
        if params.structured_outputs is not None:  # the first one builds the tokenizer's index (~1 s): not here
            await _off_the_loop(lambda: _refuse_invalid(lambda: engine.inputs.grammar(params)))
        if fills_context:
            params = params.with_max_tokens(max(1, engine.max_model_len - len(ids)))
        reply.request_id = f"cmpl-{uuid.uuid4().hex}"
        reply.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # No await from here to add_request: the queue read, the decision and the join are one step of the
        # event loop, so no other request slips in between and every limit holds under any burst.
        checked = _refuse_invalid(lambda: engine.inputs.process(prompt, params, ids))  # a 400 before any 429
        checked, degraded = _admit(checked, own_timeout_s)
        try:  # queued at once; the core stops it at its deadline, wherever it is
            outputs = engine.add_input(checked, reply.request_id, arrival_s, body.priority, timeout_s)
        except EngineDeadError as error:
            raise ApiError(503, str(error), code="engine_unavailable") from error
        except ValueError as error:
            raise ApiError(400, str(error), param=_param_of(error)) from error
        headers = {degrade.HEADER: degrader.modes.describe()} if degraded else None
        timeout_message = f"the request took longer than its timeout of {timeout_s:g} s"
        if body.stream:
            return StreamingResponse(_sse(reply, outputs, timeout_message), media_type="text/event-stream",
                                     headers=headers)  # fmt: skip
        final = await _last(outputs)
        if final.finish_reason == "deadline":
            raise ApiError(504, timeout_message, code="timeout", admitted=True)
        if final.finish_reason == "error" and lifetime.draining:
            raise ApiError(503, final.error, code="shutting_down", admitted=True)
        if final.finish_reason == "error":
            raise ApiError(500, final.error or "the request failed in the engine", code="engine_error", admitted=True)
        return JSONResponse(reply.body(final), headers=headers)

    def _admit(request: EngineInput, own_timeout_s: float | None) -> tuple[EngineInput, bool]:
        """Admit the request or raise its 429; return it as admitted (degraded modes may lower its
        ``max_tokens``, which keeps it valid) and whether those modes were applied. Synchronous: the caller
        joins the queue right after."""
        queue, degraded = observe_load()
        params, refusal = request.params, None
        if degraded:
            params, refusal = degrader.apply(request.num_prompt_tokens, params, queue)
        facts = RequestFacts(request.num_prompt_tokens, params.max_tokens, own_timeout_s)
        _raise_if_refused(refusal or admission.decide(facts, queue))
        return dataclasses.replace(request, params=params), degraded

    def _raise_if_refused(refusal: Refusal | None) -> None:
        if refusal is not None:
            retry_after = retry_after_header(refusal.retry_after_s, config.retry_after_s)
            raise ApiError(429, refusal.message, code=refusal.reason, headers={"Retry-After": retry_after})

    async def _sse(reply: Reply, outputs: AsyncIterator[RequestOutput], timeout_message: str) -> AsyncIterator[str]:
        first = True
        try:
            async for output in outputs:
                if output.finish_reason == "error":
                    message = output.error or "the request failed in the engine"
                    yield sse_event(error_body(message, code="engine_error", kind="server_error"))
                    break
                if output.finish_reason == "deadline":
                    yield sse_event(error_body(timeout_message, code="timeout", kind="timeout"))
                    break
                if output.delta_text or output.finished:
                    yield sse_event(reply.chunk(output, first))
                    first = False
                if output.finished:
                    if reply.include_usage:
                        yield sse_event(reply.usage_chunk(output))
                    yield "data: [DONE]\n\n"
        except Exception:  # the status line is sent: the stream ends with an error event, never silently
            logger.exception("stream %s failed", reply.request_id)
            yield sse_event(error_body("the stream failed on the server", code="internal_error", kind="server_error"))
        finally:
            await outputs.aclose()  # a disconnect lands here: aclose cancels the request in the engine

    return app


def _params(body: SamplingFields, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
    """The engine's settings for a request; a value the engine refuses is a 400 naming its field."""
    return _refuse_invalid(lambda: body.sampling_params(max_tokens, top_logprobs))


def _own_timeout_s(body_s: float | None, header: str | None, server_timeout_s: float) -> float | None:
    """The timeout a request sent itself, seconds: the shorter of its body's ``timeout`` and its
    ``X-Request-Timeout`` header, capped by the server's; ``None`` if it sent neither."""
    sent = [] if body_s is None else [body_s]
    if header is not None:
        try:
            header_s = float(header)
        except ValueError:
            header_s = math.nan
        if not (math.isfinite(header_s) and header_s >= MIN_TIMEOUT_S):
            raise ApiError(400, f"{TIMEOUT_HEADER}: must be a number of seconds ≥ {MIN_TIMEOUT_S:g}, got {header!r}",
                           param=TIMEOUT_HEADER)  # fmt: skip
        sent.append(header_s)
    return min(*sent, server_timeout_s) if sent else None


def _refuse_invalid(check: Callable):
    """Run ``check``; a ``ValueError`` (the engine's own messages start with the field) becomes a 400."""
    try:
        return check()
    except ValueError as error:
        raise ApiError(400, str(error), param=_param_of(error)) from error


def _param_of(error: ValueError) -> str:
    """The field an engine error message names: ``"SamplingParams.top_p must …"`` → ``top_p``."""
    return str(error).split(":")[0].removeprefix("SamplingParams.").split()[0]


async def _off_the_loop(work: Callable[[], object]) -> object:
    """Run CPU work (a chat template, the tokenizer) in a worker thread: the event loop stays free to serve."""
    return await asyncio.to_thread(work)


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    try:
        async for output in outputs:
            final = output
    finally:
        await outputs.aclose()
    return final


def _install_error_handlers(app: FastAPI, refuse: Callable[..., JSONResponse]) -> None:
    """Every error the server sends is OpenAI's shape; none carries a traceback."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return refuse(400, *_validation_message(_most_telling(error.errors())))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        if error.admitted:  # it ran, and ended badly: the engine's own counters have it
            return _error(error.status, error.message, error.param, error.code, error.headers)
        return refuse(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):  # 404 and 405 (with its Allow)
        return refuse(error.status_code, str(error.detail), None, f"http_{error.status_code}", error.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error(500, "the server failed on this request; its log has the details", code="internal_error")


def _most_telling(errors: list[dict]) -> dict:
    """The complaint that names the real problem. A value matching no member of a union (``prompt: [-1]``)
    gets one complaint per member, the first usually "should be a valid string": prefer one about the value
    itself (a bound, a length) over one that only says its type is another member's."""
    first = errors[0]
    field = first.get("loc", ())[:2]
    for error in errors:
        if error.get("loc", ())[:2] == field and not str(error.get("type", "")).endswith("_type"):
            return error
    return first


def _validation_message(first: dict) -> tuple[str, str | None]:
    """A readable message and the field it is about, from pydantic's first complaint."""
    location = [part for part in first.get("loc", ()) if part != "body"]
    # Union members add their type to the path ("prompt", "str"): keep field names and list indices only.
    path = [str(p) for p in location if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    param = ".".join(path) or None
    kind = first.get("type")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON{f' ({detail})' if detail else ''}", None
    if kind == "missing" and param is None:
        return "the request body is empty: send a JSON object", None
    if kind == "model_attributes_type" and param is None:
        return "the request body must be a JSON object", None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix for ours
    return f"{param + ': ' if param else ''}{message}", param


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "constrained-str", "function-after"}


def _documented(model: type) -> dict:
    """The OpenAPI responses of a generation route: its body (or a stream), and every error it can send."""
    ok = {"model": model, "description": "the answer, or with stream: true, server-sent events",
          "content": {"text/event-stream": {}}}  # fmt: skip
    return {200: ok, **_GENERATION_RESPONSES}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, corrected: invalid requests are 400 here (FastAPI documents its own 422)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    kind = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status)
    if status >= 500 and status != 503:
        kind = "server_error"
    return JSONResponse(error_body(message, param, code, kind or "invalid_request_error"), status, headers=headers)


__all__ = ["ApiError", "create_app"]

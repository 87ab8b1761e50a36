"""An OpenAI-compatible HTTP server over the engine: completions, chat completions, models, health, metrics.

    minserve serve --model minserve-tiny --port 8000
    curl localhost:8000/v1/completions -d '{"model": "minserve-tiny", "prompt": "def fib(n):", "max_tokens": 32}'

Every request is checked before it reaches the engine and refused with an OpenAI-style 4xx body naming the
field. Admission is bounded: past ``max_waiting_requests`` queued requests the answer is 429 with
Retry-After, at once. A client that disconnects mid-stream cancels its request, freeing its KV blocks; a
request past ``request_timeout_s`` is cancelled too. On shutdown, running requests are drained first.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from minserve.config import ServerConfig
from minserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams
from minserve.serve.metrics import ServerMetrics
from minserve.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body, finish_reason


@dataclass
class _Prepared:
    """A checked request, ready for the engine."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    include_usage: bool
    model: str
    arrival_time_s: float  # time.perf_counter() when the server began handling it
    priority: int = 0


class ApiError(Exception):
    """An OpenAI-style error answer. ``admitted``: the request had reached the engine (a timeout, say)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, admitted: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.admitted = status, message, param, code, admitted


class RequestGuard:
    """API key and body size, checked before anything is parsed.

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
    would pass every chunk of every stream through an extra queue and task switch.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig, refuse: Callable[..., JSONResponse]) -> None:
        self.app, self.config, self.refuse = app, config, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = self._problem(scope["path"], dict(scope["headers"]))
            if problem is not None:
                await self.refuse(*problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _problem(self, path: str, headers: dict[bytes, bytes]) -> tuple[int, str, None, str] | None:
        if self.config.api_key and path != "/health":
            supplied = headers.get(b"authorization", b"").decode(errors="replace").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(supplied, self.config.api_key):
                return 401, "invalid or missing API key (Authorization: Bearer …)", None, "invalid_api_key"
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.config.max_body_bytes:
            return 413, f"request body over {self.config.max_body_bytes} bytes", None, "body_too_large"
        return None


def create_app(engine: AsyncLLMEngine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics()
    engine.on_finished = metrics.observe_finished  # every finished request, cancelled ones included
    state = {"draining": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state["draining"] = True  # refuse new work, let what runs finish
        deadline = time.monotonic() + config.shutdown_drain_s
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        engine.shutdown(trace_out=config.trace_out)

    app = FastAPI(title="minserve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    def refuse(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        """An error answer for a request that never reached the engine, counted by reason."""
        metrics.requests_rejected.labels(reason=code or "invalid").inc()
        headers = {"Retry-After": str(config.retry_after_s)} if status in (429, 503) else None
        return _error(status, message, param, code, headers)

    app.add_middleware(RequestGuard, config=config, refuse=refuse)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        return refuse(400, f"{param + ': ' if param else ''}{message}", param=param)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        if error.admitted:  # it ran, and ended badly: the engine's own counters have it
            return _error(error.status, error.message, error.param, error.code)
        return refuse(error.status, error.message, error.param, error.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return refuse(error.status_code, str(error.detail), code=f"http_{error.status_code}")

    @app.get("/health")
    async def health():
        if not engine.is_alive and not state["draining"]:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return {"status": "draining" if state["draining"] else "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "minserve"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prepared = _prepare(body, body.prompt, body.max_tokens)
        return await _respond(prepared, body.stream, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        try:
            prompt = engine.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        except ValueError as error:
            raise ApiError(400, str(error), param="messages") from error
        prepared = _prepare(body, prompt, body.max_completion_tokens or body.max_tokens)
        return await _respond(prepared, body.stream, "chat.completion")

    def _prepare(body: SamplingFields, prompt: str | list[int], max_tokens: int | None) -> _Prepared:
        arrival_s = time.perf_counter()
        if state["draining"]:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        try:
            ids = engine.inputs.encode(prompt)
            params = SamplingParams(
                max_tokens=max_tokens or max(1, engine.max_model_len - len(ids)),
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop,
                ignore_eos=body.ignore_eos,
            )
            engine.inputs.check_fits(ids, params)
        except ValueError as error:
            message = str(error)
            param = message.split(":")[0].removeprefix("SamplingParams.").split()[0]
            raise ApiError(400, message, param=param) from error
        if engine.stats().num_waiting >= config.max_waiting_requests:
            raise ApiError(429, "the waiting queue is full; retry later", code="queue_full")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return _Prepared(request_id, prompt, ids, params, include_usage, model_name, arrival_s, body.priority)

    async def _respond(prepared: _Prepared, stream: bool, kind: str):
        outputs = engine.generate(
            prepared.prompt, prepared.params, prepared.request_id, prepared.prompt_token_ids, prepared.arrival_time_s,
            prepared.priority,
        )  # fmt: skip
        if stream:
            return StreamingResponse(_sse(prepared, outputs, kind), media_type="text/event-stream")
        try:
            final = await asyncio.wait_for(_last(outputs), timeout=config.request_timeout_s)
        except asyncio.TimeoutError as error:  # not the builtin TimeoutError before Python 3.11
            message = f"the request took longer than {config.request_timeout_s} s"
            raise ApiError(504, message, code="timeout", admitted=True) from error
        except EngineDeadError as error:
            raise ApiError(503, str(error), code="engine_error", admitted=True) from error
        return _body(prepared, final, kind, final.text)

    async def _sse(prepared: _Prepared, outputs: AsyncIterator[RequestOutput], kind: str) -> AsyncIterator[str]:
        deadline = time.monotonic() + config.request_timeout_s
        first = True
        try:
            async for output in outputs:
                if output.delta_text or output.finished:
                    yield _event(_chunk(prepared, output, kind, first))
                    first = False
                if output.finished:
                    if prepared.include_usage:
                        yield _event({**_envelope(prepared, kind, chunk=True), "choices": [], "usage": _usage(output)})
                    yield "data: [DONE]\n\n"
                elif time.monotonic() > deadline:  # leaving the loop cancels the request in the engine
                    message = f"the request took longer than {config.request_timeout_s} s"
                    yield _event(error_body(message, code="timeout", kind="timeout"))
                    break
        except EngineDeadError as error:
            yield _event(error_body(str(error), code="engine_error", kind="server_error"))
        finally:
            await outputs.aclose()  # a disconnect lands here: aclose cancels the request in the engine

    return app


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    try:
        async for output in outputs:
            final = output
    finally:
        await outputs.aclose()
    return final


def _envelope(prepared: _Prepared, kind: str, chunk: bool) -> dict:
    obj = f"{kind}.chunk" if chunk and kind == "chat.completion" else kind
    return {"id": prepared.request_id, "object": obj, "created": int(time.time()), "model": prepared.model}


def _chunk(prepared: _Prepared, output: RequestOutput, kind: str, first: bool) -> dict:
    if kind == "chat.completion":  # as OpenAI does, only the first delta names the role
        delta = {"role": "assistant", "content": output.delta_text} if first else {"content": output.delta_text}
        choice = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": output.delta_text, "logprobs": None}
    choice["finish_reason"] = finish_reason(output)
    return {**_envelope(prepared, kind, chunk=True), "choices": [choice]}


def _body(prepared: _Prepared, output: RequestOutput, kind: str, text: str) -> dict:
    if kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = finish_reason(output)
    return {**_envelope(prepared, kind, chunk=False), "choices": [choice], "usage": _usage(output)}


def _usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    kind = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status)
    return JSONResponse(error_body(message, param, code, kind or "invalid_request_error"), status, headers=headers)

"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

The client posts to ``/v1/completions`` (or ``/v1/chat/completions``) with ``stream: true`` and
``stream_options: {"include_usage": true}``, reads the server-sent events (``data: {...}`` lines, ending with
``data: [DONE]``) and records, on one clock, when each *content* chunk came. A chunk with empty text (a role
announcement, the final usage chunk) is not a token the user sees, so it does not count for TTFT or ITL.

A request ends in one of three ways: ``ok`` (``[DONE]`` seen), ``failed`` (with an ``error`` kind such as
``http_429``, ``timeout``, ``connection``, ``server_error``, ``incomplete_stream``, or ``throttled`` when the
client's own adaptive throttle refused it) or ``cancelled`` (the client hung up on purpose, after
``cancel_after_chunks`` chunks).

With a retrier (:mod:`minserve.client`: backoff with jitter honouring ``Retry-After``, a retry budget,
adaptive throttling), a request refused for load (429, 503) or left unanswered is sent again; its record
keeps the first attempt's send time, so its latency includes the retries, and counts its ``attempts``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from minserve.bench.workload import BenchRequest
from minserve.client import Outcome, Retrier, http_outcome, parse_retry_after

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DONE = "[DONE]"
DEADLINE_HEADER = "X-Request-Timeout"  # seconds: the request's own timeout, as minserve's server reads it
DEADLINE_GRACE_S = 1.0  # with the deadline sent, how much longer the client waits for the server's 504


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds from the start of the run, on one clock.

    ``intended_s`` is when the timetable said to send it, ``sent_s`` when the client actually did (the gap
    is the client's own lag); ``chunk_times_s`` holds every content chunk's arrival; ``end_s`` the last
    byte (or the hang-up, or the error). ``output_tokens`` comes from the server's usage chunk when it sent
    one, else from a local tokenizer when the client has one, else it is the number of content chunks;
    ``output_tokens_source`` says which (``usage``, ``tokenizer`` or ``chunks``).
    """

    index: int
    intended_s: float
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    status: str = "ok"
    error: str | None = None
    error_message: str | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens_source: str = "chunks"
    response_id: str | None = None  # the server's id for the request, to find it in the server's logs
    text: str = ""
    attempts: int = 1  # sent to the server (0: the client's throttle refused it), retries included
    retries_stopped_by: str | None = None  # max_attempts, budget or throttled: why it was not tried again
    retry_after_s: float | None = None  # the last refusal's Retry-After

    @property
    def first_chunk_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def client_lag_s(self) -> float:
        """Actual − intended send time, seconds: the load tester's own overhead, not the server's."""
        return self.sent_s - self.intended_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send. ``timeout_s`` bounds one request from send to last byte."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    # Ask for exactly max_tokens: ``ignore_eos`` and ``min_tokens``, extensions to the OpenAI schema; leave it
    # off for servers that reject unknown fields.
    ignore_eos: bool = False
    # Counts the tokens of a text with the model's tokenizer, for servers that send no usage.
    count_tokens: Callable[[str], int] | None = None
    # Makes the retrier of one run (a fresh one each run: its budget and throttle start empty); None: no retries.
    make_retrier: Callable[[], Retrier] | None = None
    # Send ``timeout_s`` to the server as the request's deadline (header X-Request-Timeout; minserve honours
    # it, others ignore it) and let the server's answer decide: the client then waits DEADLINE_GRACE_S longer
    # for the 504. Two clocks racing would let the server finish a request the client has already given up on.
    send_deadline: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {tuple(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.send_deadline:
            headers[DEADLINE_HEADER] = f"{self.timeout_s:g}"
        return headers

    @property
    def wait_s(self) -> float:
        """How long the client waits for one request before it hangs up, seconds."""
        return self.timeout_s + (DEADLINE_GRACE_S if self.send_deadline else 0.0)


def request_body(config: ClientConfig, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for one request."""
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:  # two spellings of "exactly max_tokens"; servers ignore the one they do not know
        body["ignore_eos"] = True  # vLLM, SGLang, minserve
        body["min_tokens"] = request.max_tokens  # vLLM, llama-cpp-python's server
    return body


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of a server-sent event stream: the decoded JSON of a ``data:`` line, ``DONE`` or ``None``.

    Blank lines (event separators), comments (``:``) and other fields (``event:``, ``id:``) give ``None``.
    """
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == DONE:
        return DONE
    return json.loads(payload) if payload else None


def chunk_text(event: dict[str, Any]) -> str:
    """The text a chunk adds: ``choices[0].text`` (completions) or ``choices[0].delta.content`` (chat)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


def error_kind(error: BaseException) -> str:
    """A short, countable name for why a request failed."""
    if isinstance(error, (httpx.TimeoutException, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(error, (httpx.NetworkError, httpx.RemoteProtocolError)):
        return "connection"
    if isinstance(error, json.JSONDecodeError):
        return "bad_json"
    return type(error).__name__.lower()


async def send_request(
    http: httpx.AsyncClient,
    config: ClientConfig,
    request: BenchRequest,
    intended_s: float,
    clock: Callable[[], float],
) -> RequestResult:
    """Send one request, stream its answer and return what was seen. Never raises for a failed request."""
    result = RequestResult(index=request.index, intended_s=intended_s)
    result.sent_s = clock()
    try:
        await asyncio.wait_for(_stream(http, config, request, result, clock), timeout=config.wait_s)
    except Exception as error:  # every failure becomes a counted kind, never a crashed run
        result.status, result.error, result.error_message = "failed", error_kind(error), str(error)[:500]
    result.end_s = clock()
    if result.output_tokens_source != "usage":
        if config.count_tokens is not None and result.text:
            result.output_tokens, result.output_tokens_source = config.count_tokens(result.text), "tokenizer"
        else:
            result.output_tokens = len(result.chunk_times_s)
    return result


async def send_with_retries(
    http: httpx.AsyncClient,
    config: ClientConfig,
    request: BenchRequest,
    intended_s: float,
    clock: Callable[[], float],
    retrier: Retrier,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> RequestResult:
    """:func:`send_request` again while ``retrier`` says so; the last attempt's result, its ``sent_s`` the
    first attempt's (the user has been waiting since), with the attempts counted."""
    first_sent_s = clock()
    tries = await retrier.acall(lambda: send_request(http, config, request, intended_s, clock), outcome, sleep)
    result = tries.result
    if result is None:  # the throttle refused it before anything was sent
        result = RequestResult(request.index, intended_s, status="failed", error="throttled", end_s=clock())
        result.error_message = "refused by the client's adaptive throttle"
    result.sent_s, result.attempts, result.retries_stopped_by = first_sent_s, tries.num_attempts, tries.stopped_by
    return result


def outcome(result: RequestResult) -> Outcome:
    """What one attempt says about retrying it (:func:`minserve.client.http_outcome`): refused for load, or
    no connection before any byte arrived, is retried; anything else is final."""
    if result.error is not None and result.error.startswith("http_"):
        return http_outcome(int(result.error.removeprefix("http_")), result.retry_after_s)
    if result.error == "connection" and not result.chunk_times_s:
        return http_outcome(None)
    return Outcome(accepted=True, retryable=False)


async def _stream(
    http: httpx.AsyncClient,
    config: ClientConfig,
    request: BenchRequest,
    result: RequestResult,
    clock: Callable[[], float],
) -> None:
    """Fill ``result`` from the event stream; leaving the ``async with`` early closes the connection."""
    body = request_body(config, request)
    async with http.stream("POST", config.url, json=body, headers=config.headers()) as response:
        if response.status_code >= 400:
            detail = (await response.aread()).decode(errors="replace")
            result.status, result.error, result.error_message = "failed", f"http_{response.status_code}", detail[:500]
            result.retry_after_s = parse_retry_after(response.headers.get("retry-after"))
            return
        async for line in response.aiter_lines():
            received_s = clock()  # before decoding: the user has the bytes now
            event = parse_sse_line(line)
            if event is None:
                continue
            if event == DONE:
                return
            if "error" in event:  # an error after the 200: the stream carries it as an event
                result.status, result.error = "failed", "server_error"
                result.error_message = json.dumps(event["error"])[:500]
                return
            _take_event(event, result, received_s)
            if request.cancel_after_chunks is not None and len(result.chunk_times_s) >= request.cancel_after_chunks:
                result.status = "cancelled"
                return
    result.status, result.error = "failed", "incomplete_stream"  # the stream ended without [DONE]


def _take_event(event: dict[str, Any], result: RequestResult, received_s: float) -> None:
    """Record one decoded chunk: its time if it carries text, and the usage if it reports it."""
    result.response_id = result.response_id or event.get("id")
    text = chunk_text(event)
    if text:
        result.chunk_times_s.append(received_s)
        result.text += text
    usage = event.get("usage")
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens_source = "usage"

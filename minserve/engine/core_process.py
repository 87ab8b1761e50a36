"""The engine core in a process of its own: the step loop, fed and drained through one pipe.

Why a process and not a thread: the model's forward pass on a small model is thousands of tiny torch calls,
each of which takes and releases Python's GIL. Any other thread that wants the GIL, such as an HTTP event
loop streaming tokens, makes every one of those calls wait: measured here, a thread busy for a tenth of the
time halved the engine's throughput. vLLM moved its engine core into its own process for the same reason.

The protocol is a few tuples over a ``multiprocessing`` pipe. To the core:

* ``("add", AddRequest)``
* ``("abort", request_id)``
* ``("speculation", enabled)`` – turn speculative decoding off (a server's degraded mode) or back on
* ``("trace",)`` – send back every trace event recorded so far
* ``("ping",)`` – answer ``("pong", longest_step_s)`` between two steps: the front end's watchdog
  (:mod:`minserve.serve.watchdog`) hears from a core that makes progress, idle or busy
* ``("shutdown", trace_path_or_None)``

From the core:

* ``("ready", EngineInfo)`` once, or ``("startup_error", message)`` and the process ends;
* ``("step", [OutputDelta, ...], EngineStats, ServiceRates)`` after every step that produced something (the
  rates measured over the recent steps, :mod:`~minserve.engine.service_rates`, for admission control);
* ``("rejected", request_id, message)`` when ``add_request`` refused a request;
* ``("trace", [TraceEvent, ...])``;
* ``("pong", longest_step_s)``: the longest of the recent steps, seconds, from which the watchdog bounds how
  long a live core may stay silent;
* ``("dead", message)`` when a step raised: the core cannot vouch for its state any more and ends (the
  front end logs the message, a traceback, and starts a new core).

Only what changed crosses the pipe (new token ids, new text), so a step's message stays small however long
the requests grow; the front end keeps the running totals.

The front end owns the core's life: the core ignores SIGINT and SIGTERM, which a terminal's Ctrl-C, torchrun
and service managers send to the whole process group (:func:`~minserve.engine.workers.ignore_stop_signals`).
It ends when told (``shutdown``), or when the front end's end of the pipe closes, however the front end died.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from minserve.config import EngineConfig
from minserve.engine.engine import EngineStats, LLMEngine
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.service_rates import ServiceRateMeter
from minserve.engine.workers import ignore_stop_signals
from minserve.quant.swap import describe_weights


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to check requests itself: the limits, and where the tokenizer is."""

    model_dir: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    stats: EngineStats
    facts: dict = field(default_factory=dict)  # what the startup line and /info tell: dtype, KV cache, batch


@dataclass(frozen=True)
class AddRequest:
    """A request for the core, checked and tokenized by the front end. ``deadline_s``: seconds after arrival
    past which the core stops it (the server's request timeout)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    prompt_token_ids: list[int]
    arrival_time_s: float
    priority: int = 0
    deadline_s: float | None = None


@dataclass(frozen=True)
class OutputDelta:
    """What one step added to one request. ``metrics`` comes once, with the final delta."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    new_logprobs: list[float] | None
    metrics: RequestMetrics | None
    new_top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # with finish_reason "error"


def run_engine_core(config: EngineConfig, conn: Connection) -> None:
    """The core process's main function: build the engine, then step while there is work."""
    # A spawned process starts with no logging set up: without this, a contained failure's traceback
    # (logged by the engine) would print as a bare line.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s")
    ignore_stop_signals()  # the front end stops the core, after draining
    try:
        engine = LLMEngine(config)
    except Exception as error:  # a bad model path, an impossible configuration: say so, then end
        conn.send(("startup_error", f"{type(error).__name__}: {error}"))
        return
    info = EngineInfo(
        str(engine.model_dir),
        engine.model_config.vocab_size,
        engine.max_model_len,
        engine.scheduler_config.kv_capacity_tokens,
        engine.stats(),
        engine_facts(engine),
    )
    conn.send(("ready", info))
    meter = ServiceRateMeter()
    engine.core.observers.append(meter)
    try:
        _serve(engine, conn, meter)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the front end is gone: so is the reason to run
    finally:
        engine.shutdown()  # a tensor-parallel engine's ranks stop with it


def engine_facts(engine: LLMEngine) -> dict:
    """What a user wants to read once the server is up: the model's numbers, its cache, its batch."""
    sizes = engine.scheduler_config
    return {
        "model_dir": str(engine.model_dir),
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "checkpoint": "gguf" if str(engine.model_dir).endswith(".gguf") else "safetensors",
        "weights": describe_weights(engine.model),
        "compiled_decode": getattr(engine.runner, "compiled", None) is not None,
        "max_model_len": engine.max_model_len,
        "kv_cache_blocks": sizes.num_kv_blocks,
        "kv_block_size_tokens": sizes.block_size,
        "kv_cache_tokens": sizes.kv_capacity_tokens,
        "kv_cache_bytes": getattr(engine.runner, "kv_cache_bytes", None),  # a parallel runner may not say
        "max_num_seqs": sizes.max_num_seqs,
        "max_num_batched_tokens": sizes.max_num_batched_tokens,
    }


RECENT_STEPS = 256  # the watchdog's bound follows the longest of this many recent steps


def _serve(engine: LLMEngine, conn: Connection, meter: ServiceRateMeter) -> None:
    sent_tokens: dict[str, int] = {}  # per request, how many token ids the front end already has
    step_s: deque[float] = deque([0.0], maxlen=RECENT_STEPS)
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)  # idle: sleep until the front end sends something
        while conn.poll(0):
            if not _handle(engine, conn, conn.recv(), max(step_s)):
                return
        try:
            start_s = time.perf_counter()
            outputs = engine.step()
            step_s.append(time.perf_counter() - start_s)
        except Exception as error:
            conn.send(("dead", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
            return
        if outputs:
            deltas = [_delta(output, sent_tokens) for output in outputs]
            conn.send(("step", deltas, engine.stats(), meter.rates))


def _handle(engine: LLMEngine, conn: Connection, message: tuple, longest_step_s: float) -> bool:
    """Carry out one command; ``False`` means stop."""
    kind = message[0]
    if kind == "ping":
        conn.send(("pong", longest_step_s))
    elif kind == "add":
        r: AddRequest = message[1]
        try:
            engine.add_request(
                r.prompt, r.params, r.request_id, r.arrival_time_s, r.prompt_token_ids, r.priority, r.deadline_s
            )
        except ValueError as error:
            conn.send(("rejected", r.request_id, str(error)))
    elif kind == "abort":
        engine.abort_request(message[1])
    elif kind == "speculation":
        engine.core.speculation_enabled = message[1]
    elif kind == "trace":
        conn.send(("trace", list(engine.core.tracer.events)))
    elif kind == "shutdown":
        if message[1] is not None:
            engine.core.tracer.save_chrome_trace(message[1])
        return False
    return True


def _delta(output: RequestOutput, sent_tokens: dict[str, int]) -> OutputDelta:
    already = sent_tokens.pop(output.request_id, 0)
    if not output.finished:
        sent_tokens[output.request_id] = len(output.token_ids)
    logprobs = None if output.logprobs is None else output.logprobs[already:]
    top_logprobs = None if output.top_logprobs is None else output.top_logprobs[already:]
    return OutputDelta(
        request_id=output.request_id,
        new_token_ids=output.token_ids[already:],
        delta_text=output.delta_text,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        num_cached_tokens=output.num_cached_tokens,
        new_logprobs=logprobs,
        metrics=output.metrics if output.finished else None,
        new_top_logprobs=top_logprobs,
        error=output.error,
    )

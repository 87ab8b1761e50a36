"""The engine for a server: the engine core steps in its own process; asyncio code awaits each request's outputs.

    engine = AsyncLLMEngine(EngineConfig.from_options(model="minserve-tiny"))
    async for output in engine.add_request("def fib(n):", SamplingParams(max_tokens=16), request_id="r1"):
        print(output.delta_text, end="")

Three parts, and the two sides never wait on each other:

* the **engine core** (:mod:`minserve.engine.core_process`) runs ``LLMEngine.step()`` in a child process, so
  the server's Python never competes with the model's forward pass for the GIL;
* this **front end**, in the server's process, checks and tokenizes requests itself (it holds the tokenizer,
  not the model) and sends them down a pipe;
* a **reader thread** receives each step's deltas, adds them to every request's running text and token ids,
  and hands the step's outputs to the event loop in one ``call_soon_threadsafe``, where each goes to its
  request's :class:`~minserve.engine.output_stream.OutputCollector`.

A consumer that falls behind (a slow client, a busy event loop) does not make outputs pile up: the collector
merges a new output into the one still waiting, text deltas concatenated, as vLLM's does. The stream then
sends several tokens in one chunk instead of one chunk per token, late.

If the core process dies (a crash, the OOM killer, a bug in a step), the reader thread logs why, ends every
request in flight with ``finish_reason="error"``, and starts a new core: the front end keeps serving. While
the new core loads, :attr:`AsyncLLMEngine.health` says ``"restarting"`` and new requests are refused.

A request's deadline is kept here too, not only in the core: a core that stops (a hung kernel, SIGSTOP)
cannot stop anything, so a request past its deadline plus ``DEADLINE_GRACE_S`` ends here with
``finish_reason="deadline"`` whatever the core does. The core answers pings between steps (``last_heard_s``,
``longest_step_s``), from which the server's watchdog (:mod:`minserve.serve.watchdog`) tells a stopped core.

Times cross processes unchanged: ``time.perf_counter`` reads the system's monotonic clock, the same in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

from minserve.config import EngineConfig
from minserve.engine.core_process import AddRequest, EngineInfo, OutputDelta, run_engine_core
from minserve.engine.engine import EngineStats, Prompt
from minserve.engine.input_processor import EngineInput, InputProcessor
from minserve.engine.output_stream import OutputCollector, RequestState, put_all
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.service_rates import PRIOR, ServiceRates
from minserve.engine.spawning import spawning_without_the_main_script
from minserve.model.tokenizer import Tokenizer
from minserve.trace import TraceEvent

STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint from disk can take minutes
SHUTDOWN_TIMEOUT_S = 10.0
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # before each consecutive restart of a core that keeps dying
STABLE_UPTIME_S = 60.0  # a core that ran this long before dying starts the backoff afresh
# The front end's own deadline comes this long after the core's: a live core stops the request itself (its
# metrics are the exact ones); this one is for a core that cannot.
DEADLINE_GRACE_S = 0.25

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not serving (restarting after a failure, or shut down): the request was refused."""


class AsyncLLMEngine:
    """The front end of an engine core process, driven from asyncio.

    ``on_finished`` is called, in the reader thread, with the final output of *every* request, including
    those cancelled after their client left and those failed by a dying core: the server counts its
    metrics there, so nothing goes unseen. Raises ``ValueError`` when the core cannot start (a bad model
    path, an impossible configuration).
    """

    def __init__(self, config: EngineConfig, on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self.config = config
        self.on_finished = on_finished
        self.num_restarts = 0  # cores started after the first one died
        self._state = "starting"  # "ok", "restarting", "stopped"
        self._last_failure: str | None = None
        self._send_lock = threading.Lock()
        self._stopping = False
        self._speculation_enabled = True  # what the core is told; a restarted core is told again
        self.last_heard_s = time.monotonic()  # when the core last sent anything (a step, a pong)
        self.longest_step_s = 0.0  # the longest of its recent steps, as its last pong said
        self._ping_outstanding = False  # one ping at a time: a stopped core must not fill the pipe
        self._start_core()
        self.tokenizer = Tokenizer(Path(self.info.model_dir))
        self.inputs = InputProcessor(
            self.tokenizer, self.info.vocab_size, self.info.max_model_len, self.info.kv_capacity_tokens
        )
        self.max_model_len = self.info.max_model_len
        self._requests: dict[str, RequestState] = {}
        self._trace_reply: list[TraceEvent] | None = None
        self._trace_ready = threading.Event()
        self._reader = threading.Thread(target=self._supervise, name="minserve-engine-reader", daemon=True)
        self._reader.start()

    def _start_core(self) -> None:
        """Spawn a core process and wait until it has loaded the model; ``ValueError`` if it cannot."""
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or CUDA state forked
        self._conn, child_conn = context.Pipe()
        # A daemonic process may not start processes of its own, and a parallel core starts its ranks.
        # Either way the core ends with the front end: its pipe closes, and it returns.
        daemon = self.config.parallel.world_size == 1
        self._process = context.Process(
            target=run_engine_core, args=(self.config, child_conn), name="minserve-engine-core", daemon=daemon
        )
        with spawning_without_the_main_script():
            self._process.start()
        child_conn.close()  # the child holds its end; closing ours lets a dead child show up as EOF
        self.info = self._wait_until_ready()
        self._stats = self.info.stats
        self._rates = PRIOR  # a new core has measured nothing yet
        self._started_at_s = self.last_heard_s = time.monotonic()
        self._ping_outstanding = False
        self._state = "ok"

    def _wait_until_ready(self) -> EngineInfo:
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self._process.kill()
            raise ValueError(f"the engine core did not start within {STARTUP_TIMEOUT_S:g} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            kind, payload = "startup_error", f"the engine core exited with code {self._process.exitcode}"
        if kind != "ready":
            self._process.join(SHUTDOWN_TIMEOUT_S)
            raise ValueError(f"the engine could not start: {payload}")
        return payload

    # --- from the event loop ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        arrival_time_s: float | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Check a request (:meth:`InputProcessor.process <minserve.engine.input_processor.InputProcessor.process>`,
        ``ValueError`` if it is bad) and queue it (:meth:`add_input`)."""
        if self._state != "ok":
            raise EngineDeadError(self._why_not_serving())
        request = self.inputs.process(prompt, params, prompt_token_ids)
        return self.add_input(request, request_id, arrival_time_s, priority, deadline_s)

    def add_input(
        self,
        request: EngineInput,
        request_id: str,
        arrival_time_s: float | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request the input processor passed now, and return the stream of its outputs. Leaving the
        stream early cancels it.

        Synchronous on purpose: the request counts as in flight (and as waiting, in :meth:`stats`, and its
        prompt in :attr:`num_queued_prompt_tokens`) the moment this returns, so a server that decides
        admission from them and then calls this, with no ``await`` between, keeps its limits exact under
        any concurrency (:mod:`minserve.admission`). A request id already in flight raises ``ValueError``;
        a core that is not serving raises :class:`EngineDeadError`. ``arrival_time_s``
        (``time.perf_counter``) defaults to now; a server passes when the request came in. ``deadline_s``:
        seconds after arrival past which the core stops the request (``finish_reason="deadline"``).
        """
        if self._state != "ok":
            raise EngineDeadError(self._why_not_serving())
        arrival_s = time.perf_counter() if arrival_time_s is None else arrival_time_s
        prompt, ids, params = request.prompt, request.prompt_token_ids, request.params
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        state = RequestState(
            OutputCollector(asyncio.get_running_loop()), prompt if isinstance(prompt, str) else None, ids, arrival_s
        )
        if deadline_s is not None:
            state.deadline_at_s = arrival_s + deadline_s + DEADLINE_GRACE_S
        self._requests[request_id] = state
        try:
            self._send(("add", AddRequest(request_id, prompt, params, ids, arrival_s, priority, deadline_s)))
        except EngineDeadError:
            self._requests.pop(request_id, None)
            raise
        return self._outputs(request_id, state)

    async def _outputs(self, request_id: str, state: RequestState) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await self._next(request_id, state)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if finished:
                self._requests.pop(request_id, None)
            else:  # the caller left (client disconnected, timeout): free the blocks; the final output is
                state.listening = False  # still counted when the core reports it
                self.abort(request_id)

    async def _next(self, request_id: str, state: RequestState) -> RequestOutput | BaseException:
        """The request's next output, or past its deadline its final one, made here: counted, and the
        request aborted in the core (a stopped core frees it when it resumes)."""
        if state.deadline_at_s is None:
            return await state.collector.get()
        try:
            return await asyncio.wait_for(state.collector.get(), max(0.0, state.deadline_at_s - time.perf_counter()))
        except TimeoutError:
            output = state.failed(request_id, "the request ran past its deadline", reason="deadline")
            self.abort(request_id)
            return self._finished_or_not(request_id, state, output)

    def ping(self) -> None:
        """Ask the core for a sign of life (its pong updates ``last_heard_s``); none while one is unanswered."""
        if self._ping_outstanding or self._state != "ok":
            return
        self._ping_outstanding = True
        with contextlib.suppress(EngineDeadError):
            self._send(("ping",))

    def fail_all(self, message: str) -> None:
        """End every request in flight now with ``finish_reason="error"`` and ``message`` (a server whose
        drain time is up), and abort each in the core."""
        requests = [r for r, state in list(self._requests.items()) if state.listening and not state.finished]
        self._fail_in_flight(message)
        for request_id in requests:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; the core frees its blocks at its next step."""
        with contextlib.suppress(EngineDeadError):  # a dead core holds no blocks to free
            self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The core's statistics as of its last step. Requests still on their way to it count as waiting."""
        stats = self._stats
        return replace(stats, num_waiting=max(stats.num_waiting, self.num_in_flight - stats.num_running))

    @property
    def rates(self) -> ServiceRates:
        """The core's prefill rate and decode step time, measured over its recent steps (as of its last)."""
        return self._rates

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens of the requests in flight that have no first token yet: the prefill work ahead of a
        new request (a prompt half prefilled in chunks counts whole, so the estimate errs long)."""
        states = list(self._requests.values())  # the reader thread may change the dict meanwhile
        return sum(len(s.prompt_token_ids) for s in states if s.listening and not s.finished and not s.token_ids)

    def set_speculation(self, enabled: bool) -> None:
        """Turn speculative decoding off or back on in the core, from its next step (no-op without it)."""
        self._speculation_enabled = enabled
        with contextlib.suppress(EngineDeadError):  # a restarted core is told when it is up
            self._send(("speculation", enabled))

    @property
    def speculation_enabled(self) -> bool:
        """Whether speculative decoding is on (it is unless :meth:`set_speculation` turned it off)."""
        return self._speculation_enabled

    @property
    def num_in_flight(self) -> int:
        """Requests someone is still waiting on, and the core still holds."""
        return sum(state.listening and not state.finished for state in list(self._requests.values()))

    @property
    def is_alive(self) -> bool:
        """Serving now: the core is up and not shutting down."""
        return self._state == "ok" and not self._stopping and self._process.is_alive()

    @property
    def health(self) -> tuple[str, str | None]:
        """``("ok" | "restarting" | "stopped", why)``: why is the last failure's short description, if any."""
        state = "restarting" if self._state == "ok" and not self._process.is_alive() else self._state
        return state, self._last_failure

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id (it changes when the core is restarted)."""
        return self._process.pid

    def _why_not_serving(self) -> str:
        if self._stopping or self._state == "stopped":
            return "the engine is shut down"
        return "the engine core failed and is restarting; retry shortly"

    def trace_events(self, timeout_s: float = 30.0) -> list[TraceEvent]:
        """Every trace event the core has recorded (blocking: call it from a thread, not the event loop)."""
        self._trace_ready.clear()
        self._send(("trace",))
        if not self._trace_ready.wait(timeout_s):
            raise TimeoutError(f"the engine core sent no trace within {timeout_s:g} s")
        return self._trace_reply or []

    def shutdown(self, trace_out: str | None = None, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core after its current step (writing its trace to ``trace_out`` first, if given); kill it
        if it has not ended within ``timeout_s`` (a stopped core never will)."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(EngineDeadError):
            self._send(("shutdown", trace_out))
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._state = "stopped"

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as error:  # the pipe is closed: the core is gone
                raise EngineDeadError(self._why_not_serving()) from error

    # --- the reader thread ------------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Read from the core until it ends; if it ended by failing, fail what was in flight and restart it."""
        failures_in_a_row = 0
        while True:
            failure = self._read_from_core()
            if failure is None or self._stopping:
                return
            self._state = "restarting"
            self._last_failure = failure.splitlines()[0]
            logger.error("the engine core failed; failing %d requests and restarting it:\n%s",
                         len(self._requests), failure)  # fmt: skip
            self._fail_in_flight()
            lived_s = time.monotonic() - self._started_at_s
            failures_in_a_row = 1 if lived_s > STABLE_UPTIME_S else failures_in_a_row + 1
            if not self._restart(RESTART_BACKOFF_S[min(failures_in_a_row, len(RESTART_BACKOFF_S)) - 1]):
                return

    def _restart(self, backoff_s: float) -> bool:
        """Start a new core after ``backoff_s``; False if shutting down or it cannot start (then stopped)."""
        time.sleep(backoff_s)
        if self._stopping:
            return False
        with contextlib.suppress(OSError):
            self._conn.close()
        try:
            self._start_core()
        except ValueError:
            logger.exception("the engine core could not be restarted; the server stays unhealthy")
            self._state = "stopped"
            return False
        self.num_restarts += 1
        if not self._speculation_enabled:
            self.set_speculation(False)
        logger.warning("engine core restarted (restart %d, pid %d)", self.num_restarts, self._process.pid)
        return True

    def _read_from_core(self) -> str | None:
        """Dispatch the core's messages; return why it ended when it failed, None when it was shut down."""
        try:
            while True:
                kind, *payload = self._conn.recv()
                self.last_heard_s = time.monotonic()
                if kind == "pong":
                    self.longest_step_s, self._ping_outstanding = payload[0], False
                elif kind == "step":
                    self._take_step(*payload)
                elif kind == "rejected":
                    request_id, message = payload
                    self._deliver([(request_id, ValueError(message))])
                    self._requests.pop(request_id, None)
                elif kind == "trace":
                    self._trace_reply = payload[0]
                    self._trace_ready.set()
                elif kind == "dead":
                    self._process.join(SHUTDOWN_TIMEOUT_S)
                    return f"a step raised {payload[0]}"
        except (EOFError, OSError):
            if self._stopping:
                return None
            self._process.join(SHUTDOWN_TIMEOUT_S)
            return f"the engine core process exited with code {self._process.exitcode}"

    def _take_step(self, deltas: list[OutputDelta], stats: EngineStats, rates: ServiceRates) -> None:
        self._stats, self._rates = stats, rates
        items: list[tuple[str, RequestOutput | BaseException]] = []
        for delta in deltas:
            state = self._requests.get(delta.request_id)
            if state is None:
                continue
            items.append((delta.request_id, self._finished_or_not(delta.request_id, state, state.apply(delta))))
        self._deliver(items)

    def _finished_or_not(self, request_id: str, state: RequestState, output: RequestOutput) -> RequestOutput:
        """Count a final output (``on_finished``) and forget a request nobody listens to any more."""
        if output.finished:
            state.finished = True
            if self.on_finished is not None:
                self.on_finished(output)
            if not state.listening:
                del self._requests[request_id]
        return output

    def _fail_in_flight(self, message: str = "the engine core failed while serving this request; it is restarting, "
                        "retry shortly") -> None:  # fmt: skip
        """End every request in flight with ``finish_reason="error"``: the core that held them is gone."""
        items = [
            (request_id, self._finished_or_not(request_id, state, state.failed(request_id, message)))
            for request_id, state in list(self._requests.items())
        ]
        self._deliver(items)
        self._stats = replace(self._stats, num_running=0, num_waiting=0, kv_blocks_used=0)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's items to their collectors: one wake-up per event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputCollector, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            state = self._requests.get(request_id)
            if state is not None and state.listening:
                by_loop.setdefault(state.collector.loop, []).append((state.collector, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed
                loop.call_soon_threadsafe(put_all, batch)

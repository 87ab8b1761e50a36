"""The engine for a server: one thread runs ``step()`` forever; asyncio code awaits each request's outputs.

The step loop is plain, blocking Python (the model forward dominates it), so it runs in its own thread and
the server's event loop stays free to accept, stream and reject. The two sides never wait on each other:

* requests go *in* through a thread-safe inbox, which the engine thread drains before every step;
* outputs come *out* through ``call_soon_threadsafe`` into a per-request ``asyncio.Queue``;
* statistics are a snapshot the engine thread refreshes after every step, so reading them costs nothing.

Only the engine thread touches the engine's state (scheduler, blocks, sequences). ``abort`` is the one
exception, and :meth:`LLMEngine.abort_request` is thread-safe for that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from minserve.config import EngineConfig
from minserve.engine.engine import EngineStats, LLMEngine, Prompt
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine's step raised: the requests in flight were failed with this error."""


@dataclass(frozen=True)
class _NewRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class _Listener:
    """Where one request's outputs go: a queue that belongs to one event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLMEngine:
    """An :class:`LLMEngine` in a background thread, driven from asyncio.

    ``on_finished`` is called, in the engine thread, with the final output of *every* request, including
    those cancelled after their client left: the server counts its metrics there, so nothing goes unseen.
    """

    def __init__(self, config: EngineConfig, on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = LLMEngine(config)
        self.on_finished = on_finished
        self._inbox: queue.SimpleQueue[_NewRequest] = queue.SimpleQueue()
        self._listeners: dict[str, _Listener] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="minserve-engine", daemon=True)
        self._thread.start()

    # --- from the event loop ----------------------------------------------------------------------------

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, prompt_token_ids: list[int] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as steps produce them. Leaving early cancels it.

        A request the engine refuses raises ``ValueError`` before anything is queued.
        """
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        # encode and check_fits read only the tokenizer and fixed limits: safe outside the engine thread.
        ids = prompt_token_ids if prompt_token_ids is not None else self.engine.encode(prompt)
        self.engine.check_fits(ids, params)
        listener = _Listener(asyncio.get_running_loop(), asyncio.Queue())
        self._listeners[request_id] = listener
        self._inbox.put(_NewRequest(request_id, prompt, params, ids))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await listener.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._listeners.pop(request_id, None)
            if not finished:  # the caller left (client disconnected, timeout): free the blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; the engine frees its blocks at its next step."""
        self.engine.abort_request(request_id)
        self._wakeup.set()

    def stats(self) -> EngineStats:
        """The engine's statistics as of its last step; requests still in the inbox count as waiting."""
        return replace(self._stats, num_waiting=self._stats.num_waiting + self._inbox.qsize())

    @property
    def num_in_flight(self) -> int:
        """Requests someone is still waiting on."""
        return len(self._listeners)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread after its current step. Requests still running are abandoned."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    # --- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished_requests() and self._inbox.empty():
                self._wakeup.wait()
                self._wakeup.clear()  # anything that arrived before this is already in the inbox
                continue
            self._admit_new_requests()
            try:
                outputs = self.engine.step()
            except Exception as error:  # a bug must fail the requests in flight, not hang them
                self._fail_everything(error)
                continue
            self._stats = self.engine.stats()
            for output in outputs:
                self._deliver(output)

    def _admit_new_requests(self) -> None:
        while not self._inbox.empty():
            new = self._inbox.get()
            if new.request_id not in self._listeners:
                continue  # cancelled before it reached the engine
            try:
                self.engine.add_request(new.prompt, new.params, new.request_id, prompt_token_ids=new.prompt_token_ids)
            except ValueError as error:
                self._send(new.request_id, error)

    def _fail_everything(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        try:
            ended = self.engine.process_aborts()
        except Exception:  # the step that failed may have left state that cannot be cleaned
            ended = []
        for output in ended:
            output.finish_reason = "error"
            if self.on_finished is not None:
                self.on_finished(output)
        self._stats = self.engine.stats()
        for request_id in list(self._listeners):
            self._send(request_id, EngineDeadError(f"the engine failed: {type(error).__name__}: {error}"))

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished and self.on_finished is not None:
            self.on_finished(output)
        self._send(output.request_id, output)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        listener = self._listeners.get(request_id)
        if listener is None:  # nobody is listening any more (the client left)
            return
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            listener.loop.call_soon_threadsafe(listener.queue.put_nowait, item)

"""A request's outputs on the front end's side of the pipe (:mod:`minserve.engine.async_engine`).

The engine core sends only what each step added to a request (an :class:`OutputDelta`). The front end keeps
each request's running totals (:class:`RequestState`) and turns every delta into a whole
:class:`RequestOutput`, which waits in the request's :class:`OutputCollector` until its consumer, a stream on
the event loop, takes it. A consumer that falls behind finds one output, not a queue: a newer one is merged
into the one still waiting, text deltas concatenated, as vLLM's collector does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from minserve.engine.core_process import OutputDelta
from minserve.engine.outputs import RequestMetrics, RequestOutput


class OutputCollector:
    """One request's latest undelivered output, on one event loop; a newer output is merged into it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """(On the event loop.) An error replaces anything pending; outputs merge, deltas concatenated."""
        pending = self._pending
        if isinstance(pending, BaseException):
            return  # the request has failed: nothing after that matters
        if isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            item.delta_text = pending.delta_text + item.delta_text  # the rest of `item` is the newer snapshot
        self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._pending = self._pending, None
        return item


@dataclass
class RequestState:
    """The front end's running totals for one request (the core sends only what each step added)."""

    collector: OutputCollector
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    deadline_at_s: float | None = None  # perf_counter time past which the front end ends it itself
    listening: bool = True  # False once the caller left: outputs are still counted, no longer delivered
    finished: bool = False  # its final output came: it holds nothing in the core, though not yet consumed

    def apply(self, delta: OutputDelta) -> RequestOutput:
        self.token_ids += delta.new_token_ids
        self.text += delta.delta_text
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.new_top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + delta.new_top_logprobs
        return RequestOutput(
            request_id=delta.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=delta.finish_reason,
            metrics=delta.metrics or RequestMetrics(arrival_time_s=self.arrival_time_s),
            num_cached_tokens=delta.num_cached_tokens,
            stop_reason=delta.stop_reason,
            delta_text=delta.delta_text,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            error=delta.error,
        )

    def failed(self, request_id: str, message: str, reason: str = "error") -> RequestOutput:
        """The final output of a request whose engine core died under it (or, ``reason="deadline"``, that
        the front end stopped at its deadline)."""
        metrics = RequestMetrics(self.arrival_time_s, finish_time_s=time.perf_counter())
        delta = OutputDelta(request_id, [], "", reason, None, 0, None, metrics, error=message)
        return self.apply(delta)


def put_all(batch: list[tuple[OutputCollector, RequestOutput | BaseException]]) -> None:
    """(On the event loop.) A step's outputs for the requests of one loop, handed over in one wake-up."""
    for collector, item in batch:
        collector.put(item)

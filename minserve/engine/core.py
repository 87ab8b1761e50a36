"""The engine core: requests in, one ``step()`` at a time, outputs out, with no model in sight.

A step admits (the scheduler decides), executes (an *executor* turns the scheduled batch into tokens),
appends each sequence's new tokens, checks its stops, and finishes what is done. Every bookkeeping rule
lives here, once: deadlines, stop tokens and strings, the length limit, waiting time, first-scheduled time,
finishing, refusing what cannot fit, containing a failure to the request it happened in.

Two things are plugged in, and they are the only difference between serving and simulating:

* the **executor** (:class:`Executor`): the model runner, which runs the model and samples; later a
  tensor-parallel group of workers; or, in the simulator, a cost model that only says how long the step took;
* the **clock** (:class:`Clock`): the wall clock, or a virtual clock that the cost model moves forward.

``execute`` returns a *list* of tokens per sequence, so a step that keeps several tokens for one
sequence takes the same path: with a **proposer** (speculative decoding, :mod:`minserve.engine.speculative`)
the core asks it for drafts before each step, and after the step counts as computed only the drafts the
model kept. Observers (calibration, the profiler, the
lab, the simulator's step records) get a :class:`StepReport` after every step that ran something, instead
of reaching into the scheduler.

Every rule a step applies is here, in the order the step applies it, so that a reader (and the simulator)
finds them all in one place; what a step reports (:mod:`minserve.engine.step_report`) and the clocks
(:mod:`minserve.engine.clocks`) live beside it.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from minserve.config import SchedulerConfig
from minserve.engine.batch import ScheduledBatch
from minserve.engine.block_manager import BlockManager
from minserve.engine.clocks import Clock, WallClock
from minserve.engine.input_processor import check_fits
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampler import Sample, SamplingError
from minserve.engine.scheduler import Scheduler
from minserve.engine.sequence import Sequence, SequenceStatus
from minserve.engine.speculative.proposer import Proposer
from minserve.engine.step_report import EngineStats, ScheduledSeq, StepObserver, StepReport, step_state, trace_span_name
from minserve.engine.structured import advance
from minserve.trace import Tracer

logger = logging.getLogger(__name__)

StepResult = list[Sample] | SamplingError | None  # per sequence: its new tokens, its failure, or nothing yet


# --- what is plugged in ---------------------------------------------------------------------------------------


class Executor(Protocol):
    """What turns a scheduled batch into tokens.

    ``execute`` returns, per sequence of the batch in order: the tokens it produced (a list; empty or None
    while its prompt is still being prefilled), or a :class:`SamplingError` that fails that request alone.
    It may raise, which fails every request of the batch. ``swap`` copies KV blocks to and from host memory
    before the step (``(device, host)`` pairs out, ``(host, device)`` pairs in). ``clear`` zeroes blocks a
    failed request leaves behind, so that its keys and values (NaN, perhaps) never reach the next holder.
    """

    def execute(self, batch: ScheduledBatch) -> list[StepResult]: ...

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None: ...

    def clear(self, block_ids: list[int]) -> None: ...


# --- the core -------------------------------------------------------------------------------------------------


class EngineCore:
    """The step loop over a scheduler, a block manager, an executor and a clock.

    ``stop_token_ids`` end a request (unless it asked ``ignore_eos``). A tracer records each request's life
    (:mod:`minserve.trace`); pass a disabled one to record nothing.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        clock: Clock | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        tracer: Tracer | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer
        # Off: no drafts are asked for (the proposer catches up later); a server under load turns it off.
        self.speculation_enabled = True
        self.executor = executor
        self.clock = clock or WallClock()
        self.stop_token_ids = stop_token_ids
        self.tracer = tracer or Tracer(enabled=False)
        self.max_model_len = config.max_model_len  # None: no context limit (a simulation may run without one)
        if not config.sized:
            raise ValueError("the engine core needs a KV block count: SchedulerConfig(num_kv_blocks=…)")
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.host_blocks
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
        )
        self.requests: dict[str, Sequence] = {}
        self.observers: list[StepObserver] = []
        self.num_steps = 0  # steps that ran something
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._pending_aborts: list[str] = []
        self._lock = threading.Lock()  # guards _pending_aborts: a server aborts from another thread

    # --- requests in -----------------------------------------------------------------------------------------

    def add(
        self, seq: Sequence, tokenized_s: float | None = None, tokenize_s: tuple[float, float] | None = None
    ) -> None:
        """Queue a sequence. Refuses (``ValueError``, nothing changed) a duplicate id or one that can never fit.

        For the trace: ``tokenize_s`` is when tokenizing its prompt began and ended (a ``tokenize`` span);
        without it, ``tokenized_s`` is when it was tokenized (default: now).
        """
        check_fits(len(seq.prompt_token_ids), seq.params.max_tokens, self.max_model_len, self.config.kv_capacity_tokens)
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        now = self.clock.now()
        self.tracer.instant(seq.request_id, "arrival", seq.metrics.arrival_time_s, prompt_tokens=seq.num_tokens)
        if tokenize_s is not None:
            self.tracer.span(seq.request_id, "tokenize", *tokenize_s, tokens=len(seq.prompt_token_ids))
            tokenized_s = tokenize_s[1]
        self.tracer.instant(seq.request_id, "tokenized", now if tokenized_s is None else tokenized_s)
        self.tracer.instant(seq.request_id, "queued", now)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it leaves, and its blocks are freed, at the start of the next step. Thread-safe."""
        with self._lock:
            self._pending_aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_aborts)

    # --- the loop ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that produced a token or ended.

        A failure is contained where it happened. A row that cannot be sampled, or a token that cannot be
        detokenized, ends that request with ``finish_reason="error"``. An executor that raises ends the
        requests of that batch the same way (their KV was never named for the prefix cache, so no later
        request reads it); the core, its blocks and every other request go on.
        """
        began_s = self.clock.now()
        outputs = self.process_aborts() + self._expire_deadlines(began_s)
        if self.proposer is not None and self.speculation_enabled:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        # Swap copies first, even in a step that runs nothing: the blocks a swap gave up may be reused next.
        self.executor.swap(batch.swap_out, batch.swap_in)
        start_s = self.clock.now()
        self._account_waiting(batch, start_s)
        if not batch:
            return outputs
        # What was scheduled, read before the step advances it: only when someone will read the report.
        scheduled = (
            [ScheduledSeq.of(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)] if self.observers else []
        )
        try:
            results = self.executor.execute(batch)
        except Exception as error:
            logger.exception("the forward pass failed; failing the %d requests of its batch", len(batch.seqs))
            now_s = self.clock.now()
            return outputs + [self._fail(seq, error, now_s) for seq in batch.seqs]
        end_s = self.clock.now()
        self.num_steps += 1
        # Where the forward pass ended and sampling began, if the executor says (the model runner does, when
        # the engine traces); otherwise the step is one span.
        sampled_s = getattr(self.executor, "sampling_started_s", None) if self.tracer.enabled else None
        for seq, num_new, result in zip(batch.seqs, batch.num_new_tokens, results):
            num_drafts = len(seq.draft_token_ids)
            num_accepted = len(result) - 1 if num_drafts and isinstance(result, list) else 0
            times_s = (start_s, sampled_s or end_s, end_s)
            self._trace_step(seq, num_new, batch.num_tokens, times_s, bool(result), num_accepted)
            self._count_drafts(seq, num_drafts, num_accepted)
            self.scheduler.complete(seq, num_new, num_accepted)
            if result:
                outputs.append(self._take(seq, result, end_s))
        if self.observers:
            self._report(batch, scheduled, (began_s, start_s, end_s), outputs)
        return outputs

    def _count_drafts(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Add one step's drafts for ``seq`` to its request's counts and the engine's."""
        if not num_drafts:
            return
        for counts in (seq.metrics, self):
            counts.num_verify_steps += 1
            counts.num_draft_tokens += num_drafts
            counts.num_accepted_tokens += num_accepted

    def _propose_drafts(self) -> None:
        """Drafts for each running sequence that is decoding, at most one token short of what it may still
        produce (the last one always comes from the model), never for a request that wants logprobs, follows a
        structured-output format or is short of its ``min_tokens`` (the sampler masks those one token at a
        time; a draft would need the mask at every position it proposes)."""
        decoding = [
            seq
            for seq in self.scheduler.running
            if seq.num_uncomputed_tokens == 1
            and seq.output_token_ids
            and not seq.params.logprobs
            and seq.grammar is None
            and len(seq.output_token_ids) >= seq.params.min_tokens  # end tokens are held back by the sampler
        ]
        wanted = [min(self.proposer.num_speculative_tokens, self._room(seq)) for seq in decoding]
        for seq, drafts in zip(decoding, self.proposer.propose(decoding, wanted)):
            seq.draft_token_ids = drafts

    def _room(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still produce before its last, which always comes from the model."""
        room = seq.params.max_tokens - len(seq.output_token_ids) - 1
        return room if self.max_model_len is None else min(room, self.max_model_len - seq.num_tokens)

    def _account_waiting(self, batch: ScheduledBatch, now_s: float) -> None:
        """Waiting time: it starts again at a preemption and ends when a request is (re)admitted."""
        for seq in batch.preempted:
            seq.waiting_since_s = now_s
            mode = "swap" if seq.status is SequenceStatus.SWAPPED else "recompute"
            self.tracer.instant(seq.request_id, "preempted", now_s, mode=mode)
        for seq in batch.admitted:
            seq.metrics.waiting_s += now_s - seq.waiting_since_s
            if seq.num_preemptions:
                self.tracer.instant(seq.request_id, "resumed", now_s)

    def _take(self, seq: Sequence, result: list[Sample] | SamplingError, now_s: float) -> RequestOutput:
        """Append a step's tokens to ``seq`` until one stops it, or fail ``seq`` alone if that fails."""
        if isinstance(result, SamplingError):
            return self._fail(seq, result, now_s)
        try:
            for sample in result:
                reason = self._append_token(seq, sample, now_s)
                if reason is not None:  # it ends once its last token is text: after detokenizing it
                    return self._finish(seq, *reason, self.clock.now())
            return self._output(seq)
        except Exception as error:  # a detokenizer or stop check that breaks must not take the step down
            logger.exception("request %s failed after sampling", seq.request_id)
            return self._fail(seq, error, now_s)

    def process_aborts(self) -> list[RequestOutput]:
        """Finish every request cancelled since the last step, freeing its blocks now."""
        with self._lock:
            aborted, self._pending_aborts = self._pending_aborts, []
        outputs = []
        for request_id in aborted:
            seq = self.requests.get(request_id)
            if seq is None or seq.finished:
                continue
            outputs.append(self._finish(seq, "cancelled", None, self.clock.now()))
        return outputs

    def _expire_deadlines(self, now_s: float) -> list[RequestOutput]:
        """Stop every request whose deadline has passed, waiting or running."""
        late = [seq for seq in self.requests.values() if seq.deadline_s is not None and now_s > seq.deadline_s]
        return [self._finish(seq, "deadline", None, now_s) for seq in late]

    # --- one token, one stop, one finish ----------------------------------------------------------------------

    def _append_token(self, seq: Sequence, sample: Sample, now_s: float) -> tuple[str, str | int | None] | None:
        """Add one token to ``seq``; return why it stops now, if it does."""
        token = sample.token
        seq.output_token_ids.append(token)
        if seq.grammar is not None:
            advance(seq.grammar, token)
        if sample.logprob is not None:
            seq.output_logprobs.append(sample.logprob)
        if sample.top_logprobs is not None:
            seq.output_top_logprobs.append(sample.top_logprobs)
        seq.metrics.token_times_s.append(now_s)
        if len(seq.output_token_ids) == 1:
            self.tracer.instant(seq.request_id, "first_token", now_s)
        if self.tracer.enabled:  # two clock reads per token, only when someone reads the trace
            detokenize_start_s = self.clock.now()
            seq.detokenizer.add(token)
            self.tracer.span(seq.request_id, "detokenize", detokenize_start_s, self.clock.now())
        else:
            seq.detokenizer.add(token)
        return self._stop_reason(seq, token)

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        params = seq.params
        early = len(seq.output_token_ids) < params.min_tokens  # nothing but the length ends it yet
        if token in self.stop_token_ids and not params.ignore_eos and not early:
            return "stop", token
        if params.stop and not early:
            text = seq.detokenizer.text
            window_start = max(0, seq.visible_chars - max(map(len, params.stop)))
            hits = [(text.find(s, window_start), s) for s in params.stop if text.find(s, window_start) >= 0]
            if hits:
                seq.stop_at_char, matched = min(hits)
                return "stop", matched
        at_context_end = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        if len(seq.output_token_ids) >= params.max_tokens or at_context_end:
            return "length", None
        return None

    def _fail(self, seq: Sequence, error: BaseException, now_s: float) -> RequestOutput:
        """End ``seq`` with ``finish_reason="error"``, its blocks freed; the message names the error's kind."""
        seq.error = f"{type(error).__name__}: {error}" if isinstance(error, SamplingError) else type(error).__name__
        # Its KV may be NaN, and a decode step reads whole blocks (the slots past a context masked, but a
        # masked NaN still poisons a softmax): the blocks it leaves are cleared, and not found by name.
        self.executor.clear(self.scheduler.block_manager.forget_own_blocks(seq))
        return self._finish(seq, "error", None, now_s)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None, now_s: float) -> RequestOutput:
        if seq in self.scheduler.waiting or seq in self.scheduler.swapped:  # ends while waiting: that counts too
            seq.metrics.waiting_s += now_s - seq.waiting_since_s
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finish_time_s = now_s
        seq.detokenizer.flush()
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.release(seq)  # a draft model's blocks for it, a lookup index
        event = {"cancelled": "cancelled", "deadline": "deadline", "error": "failed"}.get(reason, "finished")
        self.tracer.instant(seq.request_id, event, now_s, reason=reason)
        output = self._output(seq)
        del self.requests[seq.request_id]
        return output

    def _output(self, seq: Sequence) -> RequestOutput:
        """A snapshot of ``seq`` with the text that became visible since the last one."""
        text = seq.detokenizer.text
        if seq.stop_at_char is not None:
            visible = seq.stop_at_char
        elif seq.finished or not seq.params.stop:
            visible = len(text)
        else:  # hold back what could still turn out to be the start of a stop string
            visible = max(seq.visible_chars, len(text) - max(map(len, seq.params.stop)) + 1)
        delta = text[seq.visible_chars : visible]
        seq.visible_chars = visible
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text[:visible],
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            num_cached_tokens=seq.num_cached_tokens,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs else None,
            top_logprobs=list(seq.output_top_logprobs) if seq.params.top_logprobs else None,
            error=seq.error,
            num_preemptions=seq.num_preemptions,
            delta_text=delta,
        )

    def _trace_step(
        self,
        seq: Sequence,
        num_new: int,
        batch_tokens: int,
        times_s: tuple[float, float, float],
        sampled: bool,
        num_accepted: int = 0,
    ) -> None:
        """The step's spans for ``seq``: its forward pass (``prefill`` or ``decode``, start → where sampling
        began), then ``sample`` (→ the step's end) if the step sampled it a token. A decode that carried
        drafts says how many (``drafted``) and how many the model kept (``accepted``); under tensor parallelism
        the forward's seconds in collectives are there too (``collective_s``)."""
        start_s, sampled_s, end_s = times_s
        if seq.metrics.first_scheduled_time_s is None:
            seq.metrics.first_scheduled_time_s = start_s
            self.tracer.instant(seq.request_id, "scheduled", start_s, cached_tokens=seq.num_cached_tokens)
        if not self.tracer.enabled:
            return
        kind = trace_span_name(step_state(seq, num_new))
        extra = {"drafted": len(seq.draft_token_ids), "accepted": num_accepted} if seq.draft_token_ids else {}
        # A model split across processes says how long the step's forward waited in collectives.
        if (collective_s := getattr(self.executor, "collective_s", None)) is not None:
            extra["collective_s"] = collective_s
        self.tracer.span(seq.request_id, kind, start_s, sampled_s, tokens=num_new, batch_tokens=batch_tokens, **extra)
        if sampled and sampled_s < end_s:
            self.tracer.span(seq.request_id, "sample", sampled_s, end_s)

    def _report(
        self,
        batch: ScheduledBatch,
        scheduled: list[ScheduledSeq],
        times_s: tuple[float, float, float],
        outputs: list[RequestOutput],
    ) -> None:
        scheduler = self.scheduler
        began_s, start_s, end_s = times_s
        report = StepReport(
            index=self.num_steps,
            began_s=began_s,
            start_s=start_s,
            end_s=end_s,
            finished_s=self.clock.now(),
            scheduled=scheduled,
            preempted=[seq.request_id for seq in batch.preempted],
            admitted=[seq.request_id for seq in batch.admitted],
            num_swapped_blocks=len(batch.swap_out) + len(batch.swap_in),
            waiting=[seq.request_id for seq in scheduler.waiting],
            swapped=[seq.request_id for seq in scheduler.swapped],
            num_running=len(scheduler.running),
            outputs=outputs,
        )
        for observe in self.observers:
            observe(report)

    # --- statistics -------------------------------------------------------------------------------------------

    def stats(self, kv_cache_bytes: int = 0) -> EngineStats:
        return EngineStats(
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_cache_bytes=kv_cache_bytes,
            prefix_cache_hit_rate=self.block_manager.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
            num_verify_steps=self.num_verify_steps,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

"""The engine: requests in, one ``step()`` at a time, outputs out.

A step asks the scheduler what to run, has the model runner run it, then, for every sequence that got a
token, detokenizes it, checks whether it should stop, and reports it. ``LLM.generate`` and the HTTP server
both drive this same loop, so every chapter measures the code that serves.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch

from minserve.config import EngineConfig
from minserve.engine.block_manager import BlockManager
from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.input_processor import InputProcessor
from minserve.engine.model_runner import ModelRunner
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.sampler import Sample, SamplingError, make_generator
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.scheduler import ScheduledBatch, Scheduler
from minserve.engine.sequence import Sequence, SequenceStatus
from minserve.model.backends import resolve_backend
from minserve.model.loader import load_config, load_model, resolve_dtype, resolve_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.trace import Tracer

Prompt = str | list[int]
CPU_KV_CACHE_BYTES = 256 * 2**20  # default KV budget on the CPU
GPU_MEMORY_UTILIZATION = 0.9  # default share of free GPU memory given to the KV cache

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_cache_bytes: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_running: int
    num_waiting: int

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_path(config.model)
        self.device = _resolve_device(config.device)
        self.tokenizer = Tokenizer(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, load_config(self.model_dir), self.device)
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.model.set_backend(resolve_backend(config.backend, self.device))
        self.model_config = self.model.config
        model_limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)  # tokens: prompt + output
        self.stop_token_ids = self._stop_token_ids()
        num_blocks = self._num_kv_blocks()
        num_cpu_blocks = self._num_cpu_blocks(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
        )
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, num_cpu_blocks)
        if uses_cuda_graphs(config, self.device, self.model.backend.name):
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        capacity_tokens = num_blocks * config.block_size
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len, capacity_tokens)
        self.tracer = Tracer(enabled=config.enable_tracing)
        self.requests: dict[str, Sequence] = {}
        self._request_counter = itertools.count()
        self._arrival_counter = itertools.count()
        self._pending_aborts: list[str] = []
        self._lock = threading.Lock()  # guards _pending_aborts: the server aborts from another thread

    # --- requests in -------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, index: int | None = None) -> list[int]:
        """Token ids of a prompt, checked (see :class:`InputProcessor`)."""
        return self.inputs.encode(prompt, index)

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never run: too long for the context, or for the whole KV cache."""
        self.inputs.check_fits(prompt_token_ids, params)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> str:
        """Queue one request and return its id. A bad request raises ``ValueError`` and changes nothing.

        ``prompt_token_ids`` skips tokenizing a text prompt that the caller has already encoded.
        ``priority``: lower runs first under the priority policy. ``deadline_s``: seconds after arrival past
        which the request is stopped wherever it is (``finish_reason="deadline"``), its blocks freed.
        """
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        arrival_s = time.perf_counter() if arrival_time_s is None else arrival_time_s
        params = params or SamplingParams()
        ids = prompt_token_ids if prompt_token_ids is not None else self.encode(prompt)
        self.check_fits(ids, params)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        seq = Sequence(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time_s=arrival_s),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            generator=make_generator(params, self.device),
            arrival_index=next(self._arrival_counter),
            priority=priority,
            deadline_s=None if deadline_s is None else arrival_s + deadline_s,
            waiting_since_s=arrival_s,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        now = time.perf_counter()
        self.tracer.instant(request_id, "arrival", arrival_s, prompt_tokens=len(ids))
        self.tracer.instant(request_id, "tokenized", now)
        self.tracer.instant(request_id, "queued", now)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; it leaves, and its blocks are freed, at the start of the next step. Thread-safe."""
        with self._lock:
            self._pending_aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_aborts)

    # --- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that produced a token or ended.

        A failure is contained where it happened. A row that cannot be sampled, or a token that cannot be
        detokenized, ends that request with ``finish_reason="error"``. A forward pass that raises ends the
        requests of that batch the same way (their KV was never named for the prefix cache, so no later
        request reads it); the engine, its blocks and every other request go on.
        """
        outputs = self.process_aborts() + self._expire_deadlines(time.perf_counter())
        batch = self.scheduler.schedule()
        # Swap copies first, even in a step that runs nothing: the blocks a swap gave up may be reused next.
        self.runner.swap(batch.swap_out, batch.swap_in)
        start_s = time.perf_counter()
        for seq in batch.preempted:
            seq.waiting_since_s = start_s
            mode = "swap" if seq.status is SequenceStatus.SWAPPED else "recompute"
            self.tracer.instant(seq.request_id, "preempted", start_s, mode=mode)
        for seq in batch.admitted:
            seq.metrics.waiting_s += start_s - seq.waiting_since_s
            if seq.num_preemptions:
                self.tracer.instant(seq.request_id, "resumed", start_s)
        if not batch:
            return outputs
        try:
            samples = self.runner.run(batch)
        except Exception as error:
            logger.exception("the forward pass failed; failing the %d requests of its batch", len(batch.seqs))
            now_s = time.perf_counter()
            return outputs + [self._fail(seq, error, now_s) for seq in batch.seqs]
        end_s = time.perf_counter()
        for seq, num_new, result in zip(batch.seqs, batch.num_new_tokens, samples):
            self._trace_step(seq, num_new, batch.num_tokens, start_s, end_s)
            self.scheduler.complete(seq, num_new)
            if result is not None:
                outputs.append(self._take_sample(seq, result, end_s))
        return outputs

    def _take_sample(self, seq: Sequence, result: Sample | SamplingError, now_s: float) -> RequestOutput:
        """Append a sampled token to ``seq`` (detokenize, check stops), or fail ``seq`` alone if that fails."""
        if isinstance(result, SamplingError):
            return self._fail(seq, result, now_s)
        try:
            return self._append_token(seq, result, now_s)
        except Exception as error:  # a detokenizer or stop check that breaks must not take the step down
            logger.exception("request %s failed after sampling", seq.request_id)
            return self._fail(seq, error, now_s)

    def _fail(self, seq: Sequence, error: BaseException, now_s: float) -> RequestOutput:
        """End ``seq`` with ``finish_reason="error"``, its blocks freed; the message names the error's kind."""
        seq.error = f"{type(error).__name__}: {error}" if isinstance(error, SamplingError) else type(error).__name__
        return self._finish(seq, "error", None, now_s)

    def process_aborts(self) -> list[RequestOutput]:
        """Finish every request cancelled since the last step, freeing its blocks now."""
        with self._lock:
            aborted, self._pending_aborts = self._pending_aborts, []
        outputs = []
        for request_id in aborted:
            seq = self.requests.get(request_id)
            if seq is None or seq.finished:
                continue
            outputs.append(self._finish(seq, "cancelled", None, time.perf_counter()))
        return outputs

    def _expire_deadlines(self, now_s: float) -> list[RequestOutput]:
        """Stop every request whose deadline has passed, waiting or running."""
        late = [seq for seq in self.requests.values() if seq.deadline_s is not None and now_s > seq.deadline_s]
        return [self._finish(seq, "deadline", None, now_s) for seq in late]

    def _append_token(self, seq: Sequence, sample: Sample, now_s: float) -> RequestOutput:
        token = sample.token
        seq.output_token_ids.append(token)
        if sample.logprob is not None:
            seq.output_logprobs.append(sample.logprob)
        if sample.top_logprobs is not None:
            seq.output_top_logprobs.append(sample.top_logprobs)
        seq.metrics.token_times_s.append(now_s)
        if len(seq.output_token_ids) == 1:
            self.tracer.instant(seq.request_id, "first_token", now_s)
        seq.detokenizer.add(token)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            return self._finish(seq, *reason, now_s)
        return self._output(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        params = seq.params
        if token in self.stop_token_ids and not params.ignore_eos:
            return "stop", token
        if params.stop:
            text = seq.detokenizer.text
            window_start = max(0, seq.visible_chars - max(map(len, params.stop)))
            hits = [(text.find(s, window_start), s) for s in params.stop if text.find(s, window_start) >= 0]
            if hits:
                seq.stop_at_char, matched = min(hits)
                return "stop", matched
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None, now_s: float) -> RequestOutput:
        if seq in self.scheduler.waiting or seq in self.scheduler.swapped:  # ends while waiting: that counts too
            seq.metrics.waiting_s += now_s - seq.waiting_since_s
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finish_time_s = now_s
        seq.detokenizer.flush()
        self.scheduler.finish(seq)
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
            delta_text=delta,
        )

    def _trace_step(self, seq: Sequence, num_new: int, batch_tokens: int, start_s: float, end_s: float) -> None:
        if seq.metrics.first_scheduled_time_s is None:
            seq.metrics.first_scheduled_time_s = start_s
            self.tracer.instant(seq.request_id, "scheduled", start_s, cached_tokens=seq.num_cached_tokens)
        kind = "decode" if seq.num_uncomputed_tokens == 1 and seq.output_token_ids else "prefill"
        self.tracer.span(seq.request_id, kind, start_s, end_s, tokens=num_new, batch_tokens=batch_tokens)

    # --- memory and statistics --------------------------------------------------------------------------

    def _stop_token_ids(self) -> frozenset[int]:
        """The model's EOS ids, the tokenizer's EOS and the chat template's end of turn (ChatML's <|im_end|>)."""
        return frozenset(self.model_config.eos_token_ids) | self.tokenizer.stop_token_ids

    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        element_bytes = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.config.block_size * element_bytes

    def _num_kv_blocks(self) -> int:
        """From ``num_kv_blocks``, else a byte budget, else a default sized for this device."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free_bytes, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free_bytes * GPU_MEMORY_UTILIZATION)
            else:
                enough_tokens = self.config.max_num_seqs * self.max_model_len
                budget = min(CPU_KV_CACHE_BYTES, enough_tokens * self.kv_bytes_per_block() // self.config.block_size)
        num_blocks = budget // self.kv_bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block; one block of {self.config.block_size} tokens "
                f"takes {self.kv_bytes_per_block()} bytes"
            )
        return num_blocks

    def _num_cpu_blocks(self, num_blocks: int) -> int:
        """Host blocks for swapping: from ``swap_space_bytes``, by default as many as the device has."""
        if self.config.preemption_mode != "swap":
            return 0
        if self.config.swap_space_bytes is None:
            return num_blocks
        return self.config.swap_space_bytes // self.kv_bytes_per_block()

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            prefix_cache_hit_rate=self.block_manager.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
        )


def uses_cuda_graphs(config: EngineConfig, device: torch.device, backend: str) -> bool:
    """Decode steps run as CUDA graphs on a GPU with the Triton backend, unless switched off."""
    return config.enable_cuda_graphs and device.type == "cuda" and backend == "triton"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a torch device (try 'cpu', 'cuda' or 'auto')") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu' or 'auto'")
    return resolved


__all__ = ["EngineStats", "LLMEngine", "ScheduledBatch"]

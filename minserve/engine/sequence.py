"""One request as the engine sees it: its tokens, how many of them are in the KV cache, and its blocks.

The invariant the whole engine leans on: the first ``num_computed_tokens`` tokens of ``token_ids`` have
their keys and values in the cache, in the blocks of ``block_table`` (in order, ``block_size`` per block).
Prefill, chunked prefill, decode, a prefix-cache hit, a preemption and a rejected draft all just move that
number (a rejected draft's keys and values stay in their slots, past it, until later tokens overwrite them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.outputs import RequestMetrics
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.structured import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks and is scheduled every step
    SWAPPED = "swapped"  # preempted by swap: its KV waits in host memory (cpu_block_table)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in flight. Identity is the object itself (two requests never compare equal)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # only when params.logprobs
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # only when params.top_logprobs
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)  # host blocks, while swapped out
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the full blocks, by content
    num_preemptions: int = 0
    arrival_index: int = 0  # order of arrival, set by the engine: FCFS's key
    priority: int = 0  # lower runs first under the priority policy (as in vLLM)
    steps_waited: int = 0  # steps spent waiting so far: what aging counts
    deadline_s: float | None = None  # perf_counter time past which the request is stopped
    waiting_since_s: float = 0.0  # when it last started waiting (arrival, or its latest preemption)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # what failed, when finish_reason is "error"
    visible_chars: int = 0  # characters of the detokenized text already reported to the caller
    stop_at_char: int | None = None  # where a matched stop string starts: the text ends there
    # Speculative decoding: tokens proposed for this step, run after its last token and verified by the
    # model. Never part of token_ids; the ones the model keeps are appended as outputs after the step.
    draft_token_ids: list[int] = field(default_factory=list)
    # Structured output: where the output stands in its format, advanced by every token appended.
    grammar: Matcher | None = None
    # min_tokens: the end tokens the sampler holds back until the output is that long (empty without it).
    held_back_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled (≥ 1 when running)."""
        return self.num_tokens - self.num_computed_tokens

    def completes_with(self, num_new_tokens: int) -> bool:
        """Whether running ``num_new_tokens`` more tokens computes all it has (its drafts included), so the
        step samples its next."""
        return self.num_computed_tokens + num_new_tokens == self.num_tokens + len(self.draft_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

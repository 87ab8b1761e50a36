"""Chapter 05 exercise, reference solutions (instructors: ``minserve grade ch05 --solutions``)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from minserve.engine.batch import ScheduledBatch
from minserve.engine.block_manager import BlockManager
from minserve.engine.policies import Policy, make_policy
from minserve.engine.sequence import Sequence as EngineSequence
from minserve.engine.sequence import SequenceStatus


def static_batching_steps(output_lengths: Sequence[int], batch_size: int) -> int:
    """Steps to serve the requests in batches of ``batch_size``, each batch running until its longest is done."""
    _check(output_lengths, batch_size)
    return sum(max(output_lengths[i : i + batch_size]) for i in range(0, len(output_lengths), batch_size))


def continuous_batching_steps(output_lengths: Sequence[int], batch_size: int) -> int:
    """Steps when every finished request's seat is given to the next one in line at the very next step."""
    _check(output_lengths, batch_size)
    seats = [0] * min(batch_size, len(output_lengths))  # the step after which each seat is free again
    finish = 0
    for n in output_lengths:
        free_at = heapq.heappop(seats)  # the seat that frees first takes the next request in line
        finish = max(finish, free_at + n)
        heapq.heappush(seats, free_at + n)
    return finish


def _check(output_lengths: Sequence[int], batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    if any(n < 1 for n in output_lengths):
        raise ValueError("every request produces at least one token")


def aging_bound_steps(long_prompt_tokens: int, short_prompt_tokens: int, aging_tokens_per_step: float) -> float:
    """Steps of waiting after which a long prompt ranks ahead of a short one that has just arrived."""
    if long_prompt_tokens < 1 or short_prompt_tokens < 1:
        raise ValueError("prompts have at least one token")
    if aging_tokens_per_step < 0:
        raise ValueError(f"aging_tokens_per_step must be ≥ 0, got {aging_tokens_per_step}")
    gap = long_prompt_tokens - short_prompt_tokens
    if gap <= 0:
        return 0.0
    return math.inf if aging_tokens_per_step == 0 else gap / aging_tokens_per_step


class FairShortestFirst(Policy):
    """Shortest remaining work first, aged: ``(tokens left to compute − aging × steps waited, arrival)``."""

    name = "fair-shortest-first"

    def __init__(self, aging_tokens_per_step: float = 1.0) -> None:
        if not aging_tokens_per_step >= 0:
            raise ValueError(f"aging_tokens_per_step must be ≥ 0, got {aging_tokens_per_step!r}")
        self.aging_tokens_per_step = aging_tokens_per_step

    def key(self, seq: EngineSequence) -> tuple[float, ...]:
        aged = seq.num_uncomputed_tokens - self.aging_tokens_per_step * seq.steps_waited
        return (aged, seq.arrival_index)


# --- part 3: the scheduler's step ---------------------------------------------------------------------------


class StepScheduler:
    """The engine's scheduler, preempting by recompute: the queues and bookkeeping, and the step itself."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str | Policy = "fcfs",
        enable_chunked_prefill: bool = True,
        preemption_mode: object = "recompute",
    ) -> None:
        if getattr(preemption_mode, "name", preemption_mode) != "recompute":
            raise ValueError(f"this scheduler preempts by recompute only, not {preemption_mode!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = make_policy(policy)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[EngineSequence] = []
        self.running: list[EngineSequence] = []
        self.swapped: list[EngineSequence] = []  # always empty: nothing is swapped out
        self.num_preemptions = 0
        self.num_steps = 0

    def add(self, seq: EngineSequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def complete(self, seq: EngineSequence, num_new_tokens: int, num_accepted: int = 0) -> bool:
        samples = seq.completes_with(num_new_tokens)
        seq.num_computed_tokens += num_new_tokens - (len(seq.draft_token_ids) - num_accepted)
        seq.draft_token_ids.clear()
        self.block_manager.name_full_blocks(seq)
        return samples

    def finish(self, seq: EngineSequence) -> None:
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        """Running first (chunked to the budget, preempting from the back of the policy's order when blocks
        run out), then admit waiting requests in the policy's order while budget, seats and blocks allow."""
        self.num_steps += 1
        for seq in self.waiting:
            seq.steps_waited += 1
        batch = ScheduledBatch()
        budget = self._serve_running(batch, self.max_num_batched_tokens)
        if not batch.preempted and (self.policy.admits_while_running or not self.running):
            self._admit_waiting(batch, budget)
        return batch

    def _tokens_to_run(self, num_uncomputed: int, budget: int) -> int:
        return min(num_uncomputed, budget) if self.enable_chunked_prefill else num_uncomputed

    def _serve_running(self, batch: ScheduledBatch, budget: int) -> int:
        queue = sorted(self.running, key=self.policy.key)
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = self._tokens_to_run(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, num_new)):
                victim = queue.pop() if queue else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                batch.add(seq, num_new)
                budget -= num_new
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        size = self.block_manager.block_size
        for seq in sorted(self.waiting, key=self.policy.key):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            cached = self.block_manager.find_cached_prefix(seq.token_ids)
            uncached = seq.num_tokens - len(cached) * size
            num_new = self._tokens_to_run(uncached, budget)
            if num_new > budget and batch.admitted:
                return  # unchunked, a prompt over the budget runs alone
            revived = sum(1 for block_id in cached if self.block_manager.blocks[block_id].ref_count == 0)
            blocks = -(-(len(cached) * size + num_new) // size) - len(cached) + revived
            if not self.block_manager.can_allocate(blocks):
                return  # nobody overtakes the request the policy ranks first
            self.waiting.remove(seq)
            self.block_manager.share_cached_prefix(seq, cached)
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            batch.admitted.append(seq)
            budget -= num_new

    def _preempt(self, seq: EngineSequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.draft_token_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.block_manager.free(seq)  # recompute: its KV is forgotten, its tokens are kept
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

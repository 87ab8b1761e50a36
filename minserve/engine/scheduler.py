"""The scheduler decides, every step, which sequences run and how many of their tokens.

Iteration-level (continuous) batching: a step is a budget of ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences. Running sequences are served first: a decode takes one token of the budget, a
prompt being prefilled takes as many as remain, so a long prompt is split into chunks across steps and the
decodes beside it keep producing a token every step (*chunked prefill*). What is left of the budget admits
waiting requests, as long as the block manager has blocks for them: admission control on free KV memory.
The order of both is the policy's (:mod:`minserve.engine.policies`): FCFS, priority, shortest prompt first
with aging, or static batching.

With chunked prefill off, a prompt is prefilled whole in one step, whatever the budget (at most one prompt
over the budget per step): the step that carries it takes as long as the whole prompt, and every running
decode waits that long for its next token.

When a running sequence needs a new block and none is free, the running sequence the policy ranks last is
*preempted*, by recompute or by swap (:mod:`minserve.engine.preemption`, ``preemption_mode``).

Swapped sequences come back before waiting ones are admitted. The copies a step needs are listed in its
batch (``swap_out``, ``swap_in``); the model runner makes them before the forward pass.

The scheduler never reads a clock: it counts steps. The engine stamps the times; the simulator
(:mod:`minserve.capacity.simulator`) runs this same code on a virtual clock.
"""

from __future__ import annotations

from minserve.engine.batch import ScheduledBatch
from minserve.engine.block_manager import BlockManager
from minserve.engine.policies import Policy, make_policy
from minserve.engine.preemption import PREEMPTION_MODES, Preemption, make_preemption
from minserve.engine.sequence import Sequence, SequenceStatus

__all__ = ["PREEMPTION_MODES", "ScheduledBatch", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str | Policy = "fcfs",
        enable_chunked_prefill: bool = True,
        preemption_mode: str | Preemption = "recompute",
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = make_policy(policy)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption = make_preemption(preemption_mode)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        for seq in (*self.waiting, *self.swapped):
            seq.steps_waited += 1
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if batch.preempted:
            return batch  # memory is short this step: admitting more would only thrash
        budget = self._swap_in(batch, budget)
        if not self.swapped and (self.policy.admits_while_running or not self.running):
            self._admit_waiting(batch, budget)
        return batch

    def _tokens_to_run(self, num_uncomputed: int, budget: int) -> int:
        """How many of a sequence's uncomputed tokens run this step: chunked to the budget, or all of them."""
        return min(num_uncomputed, budget) if self.enable_chunked_prefill else num_uncomputed

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        queue = sorted(self.running, key=self.policy.key)  # served first to last; victims from the back
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = self._with_drafts(seq, self._tokens_to_run(seq.num_uncomputed_tokens, budget), budget)
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

    def _with_drafts(self, seq: Sequence, num_new: int, budget: int) -> int:
        """``num_new`` plus the drafts (speculative decoding) of ``seq`` the step can carry: they take budget
        like any token, and the ones it cannot fit are dropped; if their blocks are not free, all are, since a
        guess never preempts anyone. Only a sequence that runs all it has this step keeps any."""
        room = max(0, budget - num_new) if num_new == seq.num_uncomputed_tokens else 0
        del seq.draft_token_ids[room:]
        num_new += len(seq.draft_token_ids)
        if seq.draft_token_ids and not self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, num_new)):
            num_new -= len(seq.draft_token_ids)
            seq.draft_token_ids.clear()
        return num_new

    def _swap_in(self, batch: ScheduledBatch, budget: int) -> int:
        """Bring swapped sequences back, in the policy's order, while blocks and seats allow."""
        for seq in sorted(self.swapped, key=self.policy.key):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            num_new = self._tokens_to_run(seq.num_uncomputed_tokens, budget)
            blocks = len(seq.cpu_block_table)
            grow = max(0, -(-(seq.num_computed_tokens + num_new) // self.block_manager.block_size) - blocks)
            if not self.block_manager.can_allocate(blocks + grow):
                break  # the first in line waits for memory; nobody overtakes it
            self.swapped.remove(seq)
            batch.swap_in += self.block_manager.swap_in(seq)
            self._start_running(seq, num_new, batch)
            budget -= num_new
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        for seq in sorted(self.waiting, key=self.policy.key):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            cached = self.block_manager.find_cached_prefix(seq.token_ids)
            uncached_tokens = seq.num_tokens - len(cached) * self.block_manager.block_size
            num_new = self._tokens_to_run(uncached_tokens, budget)
            if num_new > budget and batch.admitted:
                return  # unchunked, a prompt over the budget goes alone: it waits for the next step
            new_blocks = -(-(seq.num_tokens - uncached_tokens + num_new) // self.block_manager.block_size)
            if not self.block_manager.can_allocate(new_blocks - len(cached) + self._revived(cached)):
                return  # admission waits for free blocks; nobody overtakes the one the policy ranks first
            self.waiting.remove(seq)
            self.block_manager.share_cached_prefix(seq, cached)
            self._start_running(seq, num_new, batch)
            budget -= num_new

    def _start_running(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        """Admit ``seq`` (from waiting or swapped) into the running batch with ``num_new`` tokens this step."""
        self.block_manager.allocate(seq, num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.add(seq, num_new)
        batch.admitted.append(seq)

    def _revived(self, cached: list[int]) -> int:
        """Cached blocks that sit in the free queue: sharing them takes them out of it."""
        return sum(1 for block_id in cached if self.block_manager.blocks[block_id].ref_count == 0)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.draft_token_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        seq.status = self.preemption.preempt(seq, self.block_manager, batch)
        # Where it waits is the policy's key, not its place in the list.
        (self.swapped if seq.status is SequenceStatus.SWAPPED else self.waiting).append(seq)

    def complete(self, seq: Sequence, num_new_tokens: int, num_accepted: int = 0) -> bool:
        """After a step ran ``num_new_tokens`` of ``seq``: they are computed, and any block they filled is named
        for the prefix cache. True when the step sampled a token for it (its known tokens are all computed).

        With drafts, only the ``num_accepted`` the model kept count as computed; the rest roll back, and
        the drafts are cleared. Blocks are named only over tokens the sequence has, so an accepted draft's
        block is named once the engine has appended it (at the next step's ``complete``), a rejected one's
        never. The engine core and the tests' stand-in do a step's bookkeeping through this.
        """
        samples = seq.completes_with(num_new_tokens)
        seq.num_computed_tokens += num_new_tokens - (len(seq.draft_token_ids) - num_accepted)
        seq.draft_token_ids.clear()
        self.block_manager.name_full_blocks(seq)
        return samples

    def finish(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out of the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

"""The draft-model proposer: a small model with the target's vocabulary guesses the next k tokens, greedily.

It keeps a paged KV cache of its own (its own :class:`~minserve.engine.model_runner.ModelRunner` and
:class:`~minserve.engine.block_manager.BlockManager`) and one *shadow* sequence per target sequence, whose
tokens are the target's plus the drafts it proposed last. Before drafting, a shadow catches up: the target
kept some of those drafts and added a token of its own, so the shadow keeps as computed only the prefix the
two still share (the draft's own rollback) and runs the rest. Then k draft steps, each one token for every
sequence drafting, batched. Greedy drafts make the draft distribution q one-hot, so the verifier's rejection
sampling keeps the target's distribution exactly (drafting by sampling would need q itself).

The same machinery drafts with the target's own first layers (:mod:`.early_exit`): a draft model that
shares the target's weights. The draft's steps are extra forward passes: chapter 08 measures their cost c
against the target's step, the ``draft_cost`` of :func:`minserve.capacity.speculation.predicted_speedup`.
"""

from __future__ import annotations

import torch

from minserve.engine.batch import ScheduledBatch
from minserve.engine.block_manager import BlockManager
from minserve.engine.model_runner import CacheShape, ModelRunner
from minserve.engine.outputs import RequestMetrics
from minserve.engine.sampler import SamplingError
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.sequence import Sequence, SequenceStatus
from minserve.model.backends import resolve_backend
from minserve.model.llama import LlamaForCausalLM
from minserve.model.loader import load_model, resolve_model_path

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def load_draft(model: str, *, vocab_size: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The draft ``model`` (a name or a path, as ``LLM`` takes) on the target's device and dtype. Refuses a
    draft whose vocabulary is not the target's: its token ids would mean other words."""
    draft = load_model(resolve_model_path(model), dtype, device)
    if draft.config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {model!r} has a vocabulary of {draft.config.vocab_size} "
            f"tokens, the target {vocab_size}; a draft must share the target's tokenizer"
        )
    return draft


class DraftModelProposer:
    """Drafts with ``draft`` (loaded by :func:`load_draft`, or the target's early-exit view), computing with
    ``backend``, in ``num_blocks`` KV blocks of ``block_size`` tokens of its own."""

    def __init__(
        self, draft: LlamaForCausalLM, num_speculative_tokens: int, *, backend: str, num_blocks: int, block_size: int
    ) -> None:
        draft.set_backend(resolve_backend(backend, next(draft.parameters()).device))
        self.num_speculative_tokens = num_speculative_tokens
        self.max_len = draft.config.max_position_embeddings
        self.runner = ModelRunner(draft, CacheShape(num_blocks, block_size))
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._shadows: dict[Sequence, Sequence] = {}  # target sequence → its shadow

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        self._release_gone()
        wanted: dict[Sequence, int] = {}  # shadow → drafts it should get
        for seq, n in zip(seqs, num_tokens):
            if n > 0 and seq.num_tokens + n <= self.max_len:
                wanted[self._caught_up(seq)] = n
        drafts: dict[Sequence, list[int]] = {shadow: [] for shadow in wanted}
        stopped: set[Sequence] = set()
        for step in range(max(wanted.values(), default=0)):
            active = [shadow for shadow, n in wanted.items() if step < n and shadow not in stopped]
            stopped |= self._draft_step(active, drafts)
        return [drafts.get(self._shadows.get(seq), []) for seq in seqs]  # type: ignore[arg-type]

    def _draft_step(self, shadows: list[Sequence], drafts: dict[Sequence, list[int]]) -> set[Sequence]:
        """One token more for each shadow: a forward over what each has not computed yet. Returns the
        shadows whose draft stops short (no free block, or logits that cannot be sampled)."""
        batch, stopped = ScheduledBatch(), set()
        for shadow in shadows:
            num_new = shadow.num_uncomputed_tokens
            if not self.blocks.can_allocate(self.blocks.blocks_needed(shadow, num_new)):
                stopped.add(shadow)  # memory frees as sequences finish
                continue
            self.blocks.allocate(shadow, num_new)
            batch.add(shadow, num_new)
        if not batch:
            return stopped
        for shadow, num_new, result in zip(batch.seqs, batch.num_new_tokens, self.runner.execute(batch)):
            shadow.num_computed_tokens += num_new
            if isinstance(result, SamplingError) or not result:
                stopped.add(shadow)
                continue
            shadow.prompt_token_ids.append(result[0].token)
            drafts[shadow].append(result[0].token)
        return stopped

    def _caught_up(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow holding exactly its tokens, computed as far as its old tokens still agree."""
        tokens = seq.token_ids
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = self._shadows[seq] = _shadow_of(seq, tokens)
            return shadow
        old = shadow.prompt_token_ids
        agree = 0
        # The last token is always run again, even when its K/V is cached already: its logits give the next
        # draft (it was cached without them when a target step dropped drafts and kept exactly the first).
        limit = min(len(old), len(tokens) - 1, shadow.num_computed_tokens)
        while agree < limit and old[agree] == tokens[agree]:
            agree += 1
        shadow.prompt_token_ids = tokens
        shadow.num_computed_tokens = agree  # past it: a rejected draft's keys and values, overwritten later
        return shadow

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def _release_gone(self) -> None:
        """Free the shadows of sequences no longer running: preempted ones start afresh when they return."""
        for seq in [s for s in self._shadows if s.status is not SequenceStatus.RUNNING]:
            self.release(seq)


def _shadow_of(seq: Sequence, tokens: list[int]) -> Sequence:
    return Sequence(
        request_id=seq.request_id,
        prompt=None,
        prompt_token_ids=tokens,
        params=GREEDY,
        metrics=RequestMetrics(arrival_time_s=0.0),
        detokenizer=None,  # type: ignore[arg-type]  # a shadow's tokens are never turned into text
        status=SequenceStatus.RUNNING,
    )

"""Proposers: where a running sequence's draft tokens come from, one call per decode step.

The engine core asks its proposer for each running sequence that is decoding; the scheduler then runs the
sequence's last token and the drafts together, and the model runner verifies them (:mod:`.verifier`). A
proposer sees only tokens, never the model or the clock, so the simulator could run one too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol
from weakref import WeakKeyDictionary

from minserve.config.speculative import SpeculativeConfig
from minserve.engine.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from minserve.engine.sequence import Sequence
    from minserve.model.llama import LlamaForCausalLM


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """For each sequence, up to its ``num_tokens`` draft tokens to follow ``seq.token_ids`` (``[]``:
        decode plainly). All at once, so a proposer that runs a model batches them."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` has finished: drop what was kept for it."""
        ...


class NgramProposer:
    """Prompt lookup (:mod:`.ngram`), with one :class:`NgramIndex` per sequence, brought up to date with the
    tokens it gained since its last step. The indexes go when their sequences do (weak references)."""

    def __init__(self, num_speculative_tokens: int, max_n: int, min_n: int = 1) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_n, self.min_n = max_n, min_n
        self._indexes: WeakKeyDictionary[Sequence, NgramIndex] = WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [self._propose_one(seq, n) if n > 0 else [] for seq, n in zip(seqs, num_tokens)]

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)

    def _propose_one(self, seq: Sequence, num_tokens: int) -> list[int]:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.max_n, self.min_n)
        tokens = seq.token_ids
        index.extend(tokens[len(index) :])
        return index.propose(num_tokens)


def make_proposer(config: SpeculativeConfig, target: LlamaForCausalLM, **runner_options: Any) -> Proposer:
    """The proposer a config names, for the ``target`` model. ``runner_options`` are what a draft's own runner
    takes of the target engine's (``backend``, ``num_blocks``, ``block_size``)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_max, config.prompt_lookup_min)
    # A draft loads or views a model: import it only when asked.
    from minserve.engine.speculative.draft_model import DraftModelProposer, load_draft
    from minserve.engine.speculative.early_exit import early_exit_view

    if config.method == "early_exit":
        draft = early_exit_view(target, int(config.num_draft_layers or 0))
    else:
        parameter = next(target.parameters())
        draft = load_draft(
            str(config.model), vocab_size=target.config.vocab_size, dtype=parameter.dtype, device=parameter.device
        )
    return DraftModelProposer(draft, k, **runner_options)

"""Proposers: where a running sequence's draft tokens come from, one call per decode step.

The engine core asks its proposer for each running sequence that is decoding; the scheduler then runs the
sequence's last token and the drafts together, and the model runner verifies them (:mod:`.verifier`). A
proposer sees only tokens, never the model or the clock, so the simulator could run one too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol
from weakref import WeakKeyDictionary

from minserve.engine.speculative.config import SpeculativeConfig
from minserve.engine.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from minserve.engine.sequence import Sequence


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens to follow ``seq.token_ids`` (``[]``: decode plainly)."""
        ...


class NgramProposer:
    """Prompt lookup (:mod:`.ngram`), with one :class:`NgramIndex` per sequence, brought up to date with the
    tokens it gained since its last step. The indexes go when their sequences do (weak references)."""

    def __init__(self, num_speculative_tokens: int, max_n: int, min_n: int = 1) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_n, self.min_n = max_n, min_n
        self._indexes: WeakKeyDictionary[Sequence, NgramIndex] = WeakKeyDictionary()

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.max_n, self.min_n)
        tokens = seq.token_ids
        index.extend(tokens[len(index) :])
        return index.propose(num_tokens)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer a config names. The draft-model proposer is not in the engine yet: say so plainly."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    raise ValueError(
        f'speculative_config: method {config.method!r} is not served by the engine yet; use "ngram" '
        "(prompt lookup), or run the draft model's proposals through minserve.engine.speculative.verify"
    )

"""Seeded random prompts: token ids an experiment can regenerate exactly, and that the prefix cache never
matches by accident.

Token ids are drawn uniformly from ``[1, vocab_size)`` by numpy's default generator. Two prompts from one
draw share a cached block with probability about ``vocab_size ** -block_size`` (nil), so every prompt's
prefill is computed, unless a shared prefix is asked for on purpose. The same seed gives the same ids on every
machine.

* :func:`random_prompts`: a list of prompts of given lengths, optionally with a common prefix;
* :class:`SeededPrompts`: a stream of fresh prompts, one length at a time (the profiler's sweeps);
* :class:`RepeatedPrompts`: the same stream again after each ``rewind`` (a long context measured twice
  finds its prefill in the cache the second time).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FIRST_ID = 1  # id 0 is often padding or <unk>; ids from 1 up are ordinary tokens to the engine


def random_token_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """``length`` ids drawn from ``rng``, uniform in ``[1, vocab_size)``."""
    return rng.integers(FIRST_ID, vocab_size, size=length).tolist()


def random_prompts(
    lengths: Sequence[int], vocab_size: int, seed: int = 0, shared_prefix_tokens: int = 0
) -> list[list[int]]:
    """One prompt per length: the first ``shared_prefix_tokens`` ids common to all (drawn first), the rest
    each prompt's own, cut to its length (at least one id). Invariant: the same arguments, the same ids."""
    rng = np.random.default_rng(seed)
    prefix = random_token_ids(rng, shared_prefix_tokens, vocab_size)
    prompts = []
    for length in lengths:
        own = random_token_ids(rng, max(length - shared_prefix_tokens, 0), vocab_size)
        prompts.append((prefix + own)[: max(length, 1)])
    return prompts


class SeededPrompts:
    """Fresh prompts one at a time, from one seeded generator: ``fresh(n)`` is ``n`` new ids."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def fresh(self, length: int) -> list[int]:
        return random_token_ids(self.rng, length, self.vocab_size)


class RepeatedPrompts(SeededPrompts):
    """The same prompts again after each :meth:`rewind`: the n-th prompt of a length is always the same ids.

    For measuring decode at a long context more than once: the first round prefills the prompts, later
    rounds find their blocks in the prefix cache and skip that work (distinct prompts within a round still
    share nothing, so every sequence keeps its own KV cache to read).
    """

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        super().__init__(vocab_size, seed)
        self.made: dict[int, list[list[int]]] = {}
        self.used: dict[int, int] = {}

    def fresh(self, length: int) -> list[int]:
        made, n = self.made.setdefault(length, []), self.used.get(length, 0)
        if n == len(made):
            made.append(super().fresh(length))
        self.used[length] = n + 1
        return made[n]

    def rewind(self) -> None:
        self.used.clear()

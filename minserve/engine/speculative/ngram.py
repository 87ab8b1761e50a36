"""The n-gram (prompt-lookup) proposer: guess that the text repeats itself.

When a model edits code, quotes a document or answers about its prompt, the next tokens often already
appear earlier in the sequence. Take the last n tokens, find where they occurred before, and propose the
tokens that followed there. No model runs, so a proposal costs microseconds, and its draft distribution is
one-hot: the verifier accepts a proposed token with the target's own probability of it.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], num_tokens: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the sequence's last n
    tokens, for the longest n in ``max_n`` … ``min_n`` that has one; ``[]`` when none does.

    The longest match is the most specific evidence; among its occurrences the most recent is the nearest
    context. The proposal can be shorter than ``num_tokens`` when the match sits near the end.
    """
    if num_tokens < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"need num_tokens ≥ 1 and 1 ≤ min_n ≤ max_n, got {num_tokens}, {min_n}, {max_n}")
    tokens = list(token_ids)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # Occurrences must end before the suffix itself does, so something follows them.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = start + n
                return tokens[follow : follow + num_tokens]
    return []


class NgramIndex:
    """The proposer of :func:`propose_ngram`, kept up to date as a sequence grows.

    ``propose_ngram`` scans the whole sequence on every call: O(length × max_n) per decode step, which is the
    reference to read. A running sequence instead keeps this index: for every n-gram (``min_n`` ≤ n ≤
    ``max_n``) that has a token after it, the position of the token that followed its most recent
    occurrence. Appending a token indexes the n-grams it now follows (``max_n − min_n + 1`` dict writes);
    proposing looks up the sequence's own suffixes (as many dict reads). Invariant: ``propose(k)`` equals
    ``propose_ngram(tokens, k, max_n, min_n)`` for the tokens appended so far.
    """

    def __init__(self, max_n: int, min_n: int = 1, token_ids: Sequence[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._follower: dict[tuple[int, ...], int] = {}  # n-gram → index of the token after its latest copy
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Add one token; the n-grams that end just before it now have a follower."""
        follower = len(self.tokens)
        self.tokens.append(token)
        for n in range(self.min_n, min(self.max_n, follower) + 1):
            self._follower[tuple(self.tokens[follower - n : follower])] = follower

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            self.append(token)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens, by the rule of :func:`propose_ngram`: longest suffix first, the most
        recent earlier occurrence of it; ``[]`` when no suffix occurred before."""
        if num_tokens < 1:
            raise ValueError(f"need num_tokens ≥ 1, got {num_tokens}")
        for n in range(min(self.max_n, len(self.tokens) - 1), self.min_n - 1, -1):
            follower = self._follower.get(tuple(self.tokens[-n:]))
            if follower is not None:
                return self.tokens[follower : follower + num_tokens]
        return []

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

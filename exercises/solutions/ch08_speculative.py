"""Chapter 08 exercise, reference solutions (instructors: ``minserve grade ch08 --solutions``)."""

from __future__ import annotations

import torch

from minserve.engine.sequence import Sequence

PLACEHOLDER = -1

# --- part 1: the proposer -----------------------------------------------------------------------------------


class LookupProposer:
    """Prompt lookup: the longest suffix of 1 … ``max_n`` tokens that occurred before is followed by what
    followed its latest copy. Each sequence keeps an index, brought up to date with the tokens it gained
    since its last step, so a step costs ``max_n`` dict reads, not a scan of the sequence."""

    def __init__(self, num_speculative_tokens: int, max_n: int = 4) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_n = max_n
        self._indexes: dict[str, _SuffixIndex] = {}  # by request id; release drops one

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [self._propose_one(seq, n) if n > 0 else [] for seq, n in zip(seqs, num_tokens)]

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.request_id, None)

    def _propose_one(self, seq: Sequence, num_tokens: int) -> list[int]:
        index = self._indexes.setdefault(seq.request_id, _SuffixIndex(self.max_n))
        index.extend(seq.token_ids)
        return index.propose(num_tokens)


class _SuffixIndex:
    """For every n-gram (n ≤ ``max_n``) of a growing token list, where the token after its latest copy sits.

    Invariant: ``follower[g] = i`` means ``tokens[i − len(g) : i] == g``, the latest such ``i < len(tokens)``.
    """

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        """Catch up with ``token_ids``, of which ``self.tokens`` is a prefix (a sequence only grows)."""
        for token in token_ids[len(self.tokens) :]:
            end = len(self.tokens)  # the n-grams ending here are now followed by ``token``
            self.tokens.append(token)
            for n in range(1, min(self.max_n, end) + 1):
                self.follower[tuple(self.tokens[end - n : end])] = end

    def propose(self, num_tokens: int) -> list[int]:
        """The tokens after the latest earlier copy of the longest suffix that has one; ``[]`` if none."""
        for n in range(min(self.max_n, len(self.tokens) - 1), 0, -1):
            start = self.follower.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self._copy(start, num_tokens)
        return []

    def _copy(self, start: int, num_tokens: int) -> list[int]:
        """``num_tokens`` tokens from ``start`` on. A copy that runs past the end continues with what it has
        copied already: in a loop shorter than ``num_tokens`` (``a b a b``) the loop goes on."""
        copied: list[int] = []
        for position in range(start, start + num_tokens):
            copied.append(self.tokens[position] if position < len(self.tokens) else copied[position - len(self.tokens)])
        return copied


# --- part 2: the verifier -----------------------------------------------------------------------------------


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Rejection sampling over a batch: accept draft x with probability min(1, p(x) / q(x)), in order; at the
    first rejection emit a sample of norm(max(p − q, 0)); with none, a bonus sample of the last row."""
    batch, k = _check_shapes(draft_tokens, draft_probs, target_probs)
    rows = torch.arange(batch, device=target_probs.device)
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)
    q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    uniform = torch.rand(batch, k, generator=generator, device=target_probs.device, dtype=torch.float64)
    accepted = uniform * q_draft < p_draft  # probability min(1, p/q), without dividing by a q of 0
    num_kept = accepted.long().cumprod(dim=1).sum(dim=1)  # the drafts before the first rejection
    # The token after them: the residual at the first rejection; p's last row when every draft was kept (a
    # draft distribution of zeros there makes the residual that row itself).
    p_next = target_probs[rows, num_kept]
    q_next = torch.where((num_kept < k)[:, None], draft_probs[rows, num_kept.clamp(max=k - 1)], 0.0)
    next_token = torch.multinomial(_residual(p_next, q_next), 1, generator=generator).squeeze(1)
    positions = torch.arange(k + 1, device=target_probs.device)
    out = torch.full((batch, k + 1), PLACEHOLDER, dtype=torch.long, device=target_probs.device)
    out[:, :k] = torch.where(positions[:k] < num_kept[:, None], draft_tokens, PLACEHOLDER)
    out[rows, num_kept] = next_token
    return out


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)) per row: the part of p the accepted drafts did not cover. A row with no mass left
    (p ≈ q, a rejection that only rounding allowed) is p itself."""
    left = (p - q).clamp(min=0)
    total = left.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, left / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def _check_shapes(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> tuple[int, int]:
    batch, k = draft_tokens.shape
    if k < 1 or draft_probs.shape[:2] != (batch, k) or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"{batch} rows of {k} drafts need draft_probs [{batch}, {k}, V] and target_probs "
            f"[{batch}, {k + 1}, V], got {list(draft_probs.shape)} and {list(target_probs.shape)}"
        )
    if draft_probs.shape[2] != target_probs.shape[2]:
        raise ValueError(f"draft and target vocabularies differ: {draft_probs.shape[2]} and {target_probs.shape[2]}")
    return batch, k

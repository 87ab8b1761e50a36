"""Verify drafted tokens so that what comes out is distributed exactly as the target model's own samples.

For each drafted token x, in order, with p the target's distribution and q the draft's at that position:

* accept x with probability min(1, p(x) / q(x));
* at the first rejection, stop and sample a replacement from the residual norm(max(p − q, 0));
* if all k drafts are accepted, sample one more token (the bonus) from the target's next distribution.

Accepting with min(1, p/q) keeps min(p, q) of the mass; the residual supplies exactly the rest, p − min(p, q),
so each emitted token is a sample from p (Leviathan et al. 2023, Chen et al. 2023). A step therefore emits
between 1 and k + 1 tokens and never fewer than plain decoding. A deterministic proposer (n-gram) has a
one-hot q, so x is accepted with probability p(x), and the residual is p with x removed.

Greedy decoding is the limit where p is one-hot at the argmax: accept while the draft equals the target's
argmax, then emit the argmax (:func:`verify_greedy`), which makes the output identical to plain greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """``tokens``: the accepted drafts, then one token from the target (a replacement or the bonus), so
    ``len(tokens) == num_accepted + 1``. ``num_accepted`` counts accepted drafts (0 … k)."""

    tokens: list[int]
    num_accepted: int


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """Greedy verification. ``target_argmax[i]`` is the target's most likely token after the sequence and
    the first i drafts; it has one entry more than ``draft_tokens`` (the bonus position)."""
    _check_lengths(len(draft_tokens), len(target_argmax))
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return Verdict([*draft_tokens[:accepted], int(target_argmax[accepted])], accepted)


def verify(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Rejection-sampling verification.

    ``target_probs`` is ``[k + 1, vocab]``: row i is the target's distribution after the sequence and the
    first i drafts (row k is the bonus). ``draft_probs`` is ``[k, vocab]``, the distributions the drafts
    were sampled from, or ``None`` for a deterministic proposer (q one-hot at each draft). Both already have
    the request's temperature, top-k and top-p applied. ``generator`` makes a seeded request reproducible.
    """
    _check_lengths(len(draft_tokens), target_probs.shape[0])
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q = _one_hot(token, p) if draft_probs is None else draft_probs[i]
        if _uniform(generator) * q[token] < p[token]:  # probability min(1, p/q); a q of 0 is never drafted
            continue
        return Verdict([*draft_tokens[:i], _sample(_residual(p, q), generator)], i)
    return Verdict([*draft_tokens, _sample(target_probs[-1], generator)], len(draft_tokens))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)): the part of p the accepted drafts did not cover. It has mass whenever a
    rejection was possible; if rounding leaves none (p ≈ q), p itself is the right distribution."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token], device=like.device), 1.0)


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else "cpu"  # a generator draws on its own device
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _check_lengths(num_drafts: int, num_target_rows: int) -> None:
    if num_target_rows != num_drafts + 1:
        raise ValueError(f"{num_drafts} drafts need {num_drafts + 1} target positions, got {num_target_rows}")

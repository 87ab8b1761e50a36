"""How far a changed model (quantized, say) strays from a reference one, measured on the same tokens.

Perplexity alone hides a lot: two models can score the same text equally well and still disagree on which
token comes next. So the comparison is made token by token on one stream of text, cut into the same
windows for both models (as :mod:`.perplexity` cuts it):

* **KL divergence** ``KL(p_ref ‖ p)`` of the next-token distributions, in nats, averaged over positions:
  0 when the two agree exactly; llama.cpp reports it for its quantized files (q8_0 ≈ 0.001, q4_0 ≈ 0.07
  on Llama-3-8B);
* **top-1 agreement**, the share of positions whose most likely next token is the same;
* both models' **perplexity** on the text;
* and, from generation rather than scoring, the **greedy divergence length**: how many tokens greedy
  decoding produces before the two first differ (:func:`greedy_divergence`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

LogitsOf = Callable[[torch.Tensor], torch.Tensor]  # a 1-D window of ids → [len(window), vocab] logits


@dataclass(frozen=True)
class Agreement:
    """A candidate model against a reference on the same ``scored_tokens`` predictions."""

    kl_per_token: float  # nats: mean KL(reference ‖ candidate) of the next-token distributions
    top1_agreement: float  # share of positions where the two argmaxes are the same token
    perplexity: float  # the candidate's
    reference_perplexity: float
    scored_tokens: int


def next_token_agreement(
    reference: LogitsOf, candidate: LogitsOf, token_ids: torch.Tensor, window_tokens: int, progress: bool = False
) -> Agreement:
    """Compare ``candidate`` with ``reference`` on ``token_ids`` cut into non-overlapping windows of
    ``window_tokens``; within a window every token after the first is predicted from the ones before it."""
    windows = [w for w in token_ids.split(window_tokens) if len(w) >= 2]
    if not windows:
        raise ValueError("the text is shorter than two tokens: there is nothing to predict")
    kl = same = nll = reference_nll = 0.0
    for window in tqdm(windows, desc="agreement", unit="window", disable=not progress):
        log_p = F.log_softmax(reference(window)[:-1].float(), dim=-1)
        log_q = F.log_softmax(candidate(window)[:-1].float(), dim=-1)
        kl += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
        same += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        targets = window[1:]
        nll += F.nll_loss(log_q, targets, reduction="sum").item()
        reference_nll += F.nll_loss(log_p, targets, reduction="sum").item()
    scored = sum(len(w) - 1 for w in windows)
    return Agreement(kl / scored, same / scored, math.exp(nll / scored), math.exp(reference_nll / scored), scored)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (the shorter's length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_divergence(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt, the tokens greedy decoding gave before the two models' outputs first differ."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference outputs but {len(candidate)} candidate outputs")
    return [first_difference(r, c) for r, c in zip(reference, candidate)]

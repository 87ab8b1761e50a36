"""Turn a row of logits into a token: greedy, or temperature with top-k and top-p filtering."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import torch

from minserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.engine.sequence import Sequence


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private random stream for a seeded request, so its samples do not depend on its neighbours."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from ``logits`` (``[vocab]``, float32)."""
    if params.greedy:
        return int(logits.argmax())
    probs = filtered_probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / temperature), keeping only the top-k tokens and the top-p nucleus, renormalised."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is still short of top_p (so the first is always kept).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample_batch(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> list[tuple[int, float | None]]:
    """One (token, logprob) per row of ``logits`` (``[len(seqs), vocab]``), with each sequence's settings.

    Greedy rows are one argmax for the whole batch; sampled rows each draw from their own generator, so a
    seeded request gets the same tokens whatever else shares its batch. The logprob, for requests that ask
    for it, is the chosen token's log-probability under the model's raw distribution (before temperature
    and filtering, as vLLM reports it by default); None otherwise.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            tokens[row] = sample(logits[row], seq.params, seq.generator)
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs]
    logprobs: list[float | None] = [None] * len(tokens)
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        chosen = torch.tensor([tokens[r] for r in wanted], device=logits.device)
        values = torch.log_softmax(logits[rows], dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        for row, value in zip(wanted, values):
            logprobs[row] = value
    return list(zip(tokens, logprobs))

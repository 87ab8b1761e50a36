"""Steer a row of logits before a token is picked: logit bias, then the repetition, frequency and presence penalties.

The meanings are OpenAI's and vLLM's, in vLLM's order, for a token ``t`` of a row's logits ``x``:

* ``logit_bias[t]`` is added to ``x[t]`` (−100 … 100: at −100 the token is all but banned).
* ``repetition_penalty`` ``r`` (CTRL's, as in Hugging Face and vLLM): if ``t`` is in the prompt or the output so
  far, ``x[t] / r`` when ``x[t] > 0`` and ``x[t] · r`` otherwise, so ``r > 1`` makes ``t`` less likely either way.
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI's): ``x[t] − f · c[t] − p · (c[t] > 0)``,
  where ``c[t]`` counts ``t`` in the *output* (as vLLM counts it; the prompt is not the model's repetition).

Greedy rows are steered too: a penalty is how a greedy loop ("a leaf's fate is determined, a leaf's fate …")
is broken. The rows that use none are untouched, and the batch's rows that use any are done together, one
``[rows, vocab]`` tensor at a time. It is done in float64, where every accepted setting is a finite, non-zero
number, so no NaN can appear (``inf − inf`` or ``0 · inf`` would need a setting of 0 or ±inf, and none is
accepted); a finite logit stays finite, saturating at its type's largest value, and ±inf stays as it was.
So a row that had a finite logit still has one, and the sampler's rules for ±inf do the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minserve.engine.sampling_params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``) with each row's bias and penalties applied, given that row's settings and
    its prompt and output token ids so far. Returns ``logits`` itself when no row uses any, else a new tensor.
    Only the steps some row asks for run, each once over the steered rows, in place."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    steered = [params[i] for i in rows]
    # float64, where every accepted setting is a finite, non-zero number (5e-324 is 0 in float32, and 0 · -inf
    # is NaN) and a bias of 0.01 does not vanish into a 16-bit logit. Indexing by a list copies the rows.
    x = logits[rows].double()
    if any(p.logit_bias for p in steered):
        _add_bias_(x, steered)
    counts = token_counts([outputs[i] for i in rows], x.shape[-1], x.device)
    if any(p.repetition_penalty != 1 for p in steered):
        seen = counts > 0
        seen[_token_index([prompts[i] for i in rows], x.device)] = True
        rep = _column([p.repetition_penalty for p in steered], x)
        # x / r where x > 0, x · r elsewhere, as one sum: x⁺ / r + x⁻ · r (never inf − inf: one term is 0)
        x = torch.where(seen, x.clamp(min=0) / rep + x.clamp(max=0) * rep, x)
    if any(p.frequency_penalty for p in steered):
        x -= _column([p.frequency_penalty for p in steered], x) * counts
    if any(p.presence_penalty for p in steered):
        x -= _column([p.presence_penalty for p in steered], x) * (counts > 0)
    x = _saturated(x, logits[rows])
    if len(rows) == len(params):
        return x
    adjusted = logits.clone()
    adjusted[rows] = x
    return adjusted


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """``[len(token_lists), vocab_size]`` float64: how many times each token id occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float64, device=device)
    index = _token_index(token_lists, counts.device)
    counts.index_put_(index, torch.ones(len(index[0]), dtype=counts.dtype, device=counts.device), accumulate=True)
    return counts


def _token_index(token_lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors of every token of every list, for ``index_put``."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    ids = [t for tokens in token_lists for t in tokens]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(ids, dtype=torch.long, device=device)


def _add_bias_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` to ``x`` in place."""
    pairs = [(row, token, bias) for row, p in enumerate(params) for token, bias in (p.logit_bias or {}).items()]
    rows, tokens, biases = zip(*pairs)
    index = (torch.tensor(rows, device=x.device), torch.tensor(tokens, device=x.device))
    x.index_put_(index, torch.tensor(biases, dtype=x.dtype, device=x.device), accumulate=True)


def _saturated(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``x`` back in ``raw``'s type, a logit that would overflow it held at its largest finite value instead: a
    huge repetition penalty must not turn every seen token to -inf and leave nothing to sample. The logits
    that were ±inf already (in ``raw``) stay so."""
    narrowed = x.to(raw.dtype)
    if not bool(narrowed.isinf().any()):  # the usual case: nothing overflowed, and no logit was infinite
        return narrowed
    finite = torch.finfo(raw.dtype).max
    return torch.where(raw.isinf(), raw, x.clamp(-finite, finite).to(raw.dtype))


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """One setting per row as a ``[rows, 1]`` column that broadcasts over the vocabulary."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]

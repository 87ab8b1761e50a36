"""Turn a row of logits into a token: greedy, or temperature with top-k, top-p and min-p filtering.

A request's logit bias and repetition, frequency and presence penalties steer its row first
(:mod:`minserve.engine.penalties`), greedy or not; min-p is one more filter after temperature.

Sampling must be safe for every setting the API accepts, however extreme: a temperature of 1e-300, a top-p
of 5e-324, logits that hold ±inf. Two rules make it so. The logits are shifted so that the largest is 0
and divided by the temperature in float64 (where 1e-300 is not 0, as it would be in float32), so nothing
overflows: 0 / 1e-300 is 0, a negative number over it is -inf, which softmax maps to 0. And the most
likely token always survives the filters, so there is always something to renormalise.

A row that still cannot be sampled (NaN logits, a model bug) fails its own request, not the batch:
:func:`sample_batch` returns a :class:`SamplingError` in that row's place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minserve.engine.penalties import adjust_logits
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.structured import constrain_logits

if TYPE_CHECKING:
    from minserve.engine.sequence import Sequence


class SamplingError(ValueError):
    """One row's logits could not be turned into a token (they hold NaN, or no token is possible)."""


@dataclass(frozen=True)
class Sample:
    """One sampled token, with its log-probability and the most likely alternatives when asked for.

    ``logprob`` is the chosen token's log-probability under the model's raw distribution (before
    temperature and filtering, as vLLM reports it by default). ``top_logprobs`` maps the
    ``params.top_logprobs`` most likely token ids to theirs, most likely first.
    """

    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private random stream for a seeded request, so its samples do not depend on its neighbours."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: tuple[SequenceOf[int], SequenceOf[int]] = ((), ()),
) -> int:
    """One token id from ``logits`` (``[vocab]``), steered by ``params``' penalties given ``history``, the
    request's (prompt, output) token ids so far. Raises :class:`SamplingError` for unusable logits."""
    prompt, output = history
    return _pick(adjust_logits(logits[None], [params], [prompt], [output])[0], params, generator)


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a row of already steered logits: its argmax, or a draw from the filtered softmax."""
    if params.greedy:
        return int(logits.argmax())
    probs = filtered_probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / temperature), keeping only the top-k tokens, those at least ``min_p`` times as likely
    as the most likely, and the top-p nucleus, renormalised.

    Always a valid distribution (finite, non-negative, summing to 1, the most likely token kept), or a
    :class:`SamplingError`.
    """
    scaled = _scaled_logits(logits.double(), params.temperature)
    if 0 < params.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_largest, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0:  # the most likely token passes: its probability is ≥ min_p times itself
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()  # top-p below reads cumulative mass as a share of 1
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is still short of top_p. The first is kept whatever top_p
        # is: a top_p below float32's smallest number would otherwise round to 0 and drop everything.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        dropped = mass_before >= params.top_p
        dropped[0] = False
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits − max) / temperature in float64, with the largest at exactly 0 and nothing NaN or +inf."""
    if torch.isnan(logits).any():
        raise SamplingError("the model produced NaN logits")
    top = logits.max()
    if top == math.inf:  # tokens at +inf take all the mass, shared equally
        return torch.where(logits == math.inf, 0.0, -math.inf)
    if top == -math.inf:
        raise SamplingError("every token has probability zero (all logits are -inf)")
    return (logits - top) / temperature


def sample_batch(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> list[Sample | SamplingError]:
    """One :class:`Sample` per row of ``logits`` (``[len(seqs), vocab]``), with each sequence's settings.

    The rows with penalties or a bias are steered together first, then the rows with a structured-output
    format lose every token it forbids. Greedy rows are one argmax for the whole
    batch; sampled rows each draw from their own generator, so a seeded request gets the same tokens whatever
    else shares its batch. A row that cannot be sampled gives a :class:`SamplingError` in its place, and the
    other rows are unaffected. Log-probabilities are the model's own, before any steering (vLLM's default).
    """
    params = [seq.params for seq in seqs]
    steered = adjust_logits(logits, params, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs])
    steered = constrain_logits(steered, [seq.grammar for seq in seqs])  # a format's forbidden tokens: -inf
    steered = hold_back_end_tokens(steered, seqs)
    tokens: list[int | SamplingError] = steered.argmax(dim=-1).tolist()
    broken = torch.isnan(logits).any(dim=-1).tolist()  # argmax would pick a NaN as if it were the best
    for row, seq in enumerate(seqs):
        if broken[row]:
            tokens[row] = SamplingError("the model produced NaN logits")
        elif not seq.params.greedy:
            try:
                tokens[row] = _pick(steered[row], seq.params, seq.generator)
            except SamplingError as error:
                tokens[row] = error
            except Exception as error:  # whatever else breaks in one row fails that request, not the batch
                tokens[row] = SamplingError(f"{type(error).__name__}: {error}")
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs and isinstance(tokens[row], int)]
    logprobs = _logprobs(logits, wanted, tokens, seqs)
    return [
        token if isinstance(token, SamplingError) else Sample(token, *logprobs.get(row, (None, None)))
        for row, token in enumerate(tokens)
    ]


def hold_back_end_tokens(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """``logits`` with −inf at the end tokens of every row still short of its ``min_tokens`` (vLLM's rule:
    the output cannot end before then). ``logits`` itself when no row holds any back."""
    rows = [
        (row, seq.held_back_token_ids)
        for row, seq in enumerate(seqs)
        if seq.held_back_token_ids and len(seq.output_token_ids) < seq.params.min_tokens
    ]
    if not rows:
        return logits
    held = logits.clone()
    for row, token_ids in rows:
        held[row, list(token_ids)] = float("-inf")
    return held


def _logprobs(
    logits: torch.Tensor, rows: list[int], tokens: list, seqs: SequenceOf[Sequence]
) -> dict[int, tuple[float, dict[int, float] | None]]:
    """For each row in ``rows``: the chosen token's log-probability and, if asked, the top alternatives."""
    if not rows:
        return {}
    finite = torch.finfo(torch.float32).max  # ±inf logits would make log_softmax NaN; clamping keeps the order
    log_probs = torch.log_softmax(logits[rows].float().clamp(-finite, finite), dim=-1)
    chosen = torch.tensor([tokens[r] for r in rows], device=logits.device)
    values = log_probs.gather(1, chosen[:, None])[:, 0].tolist()
    most = max(seqs[r].params.top_logprobs for r in rows)
    top_values, top_ids = log_probs.topk(most, dim=-1) if most else (None, None)
    result = {}
    for i, row in enumerate(rows):
        k = seqs[row].params.top_logprobs
        top = dict(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else None
        result[row] = (values[i], top)
    return result

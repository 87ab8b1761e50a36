"""The model runner's side of speculation: one sequence's k + 1 rows of logits → the tokens it keeps.

Row i holds the target's logits after the sequence and its first i drafts (row k: the bonus position). A
greedy request keeps the drafts while they equal the argmax (:func:`.rejection.verify_greedy`), so its
output is exactly plain greedy decoding's; a sampled one goes through rejection sampling with the request's
own temperature, top-k, top-p, min-p and generator (:func:`.rejection.verify`), so its output is distributed
as plain sampling's. Either way a step keeps 1 … k + 1 tokens.

Penalties and a logit bias stay exact too: row i is steered as plain decoding would steer it had the first i
drafts been kept (its output so far plus those drafts), so each row is the distribution plain decoding would
sample from at that position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minserve.engine.penalties import adjust_logits
from minserve.engine.sampler import Sample, SamplingError, filtered_probabilities
from minserve.engine.speculative.rejection import Verdict, verify, verify_greedy

if TYPE_CHECKING:
    from minserve.engine.sequence import Sequence


def verify_drafts(logits: torch.Tensor, seq: Sequence) -> list[Sample] | SamplingError:
    """The tokens ``seq`` keeps from its drafts (``seq.draft_token_ids``), given ``logits``
    (``[len(drafts) + 1, vocab]``); a :class:`SamplingError` if the rows cannot be sampled."""
    drafts = seq.draft_token_ids
    if torch.isnan(logits).any():
        return SamplingError("the model produced NaN logits")
    try:
        verdict = _verdict(logits, seq, drafts)
    except SamplingError as error:
        return error
    return [Sample(token) for token in verdict.tokens]


def _verdict(logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> Verdict:
    rows = len(logits)
    outputs = [seq.output_token_ids + drafts[:i] for i in range(rows)]
    logits = adjust_logits(logits, [seq.params] * rows, [seq.prompt_token_ids] * rows, outputs)
    if seq.params.greedy:
        return verify_greedy(drafts, logits.argmax(dim=-1).tolist())
    probs = torch.stack([filtered_probabilities(row, seq.params) for row in logits])
    return verify(drafts, None, probs, seq.generator)

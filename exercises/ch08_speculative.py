"""Chapter 08 exercise: a draft-and-verify step for the real engine.

Fill in :class:`LookupProposer` and :func:`verify` (replace ``raise NotImplementedError``), then grade
yourself:

    minserve grade ch08

Speculative decoding has two halves, and you write both. Before each step the engine core asks a
**proposer** to guess the next few tokens of every decoding sequence. The model then runs each sequence's
last token and its drafts in one forward pass, which gives the target's distribution at every drafted
position and at the one after, and a **verifier** decides which drafts to keep and which token comes next.

Part 1 is the proposer, an n-gram (prompt-lookup) proposer of your own design: no model, only the tokens,
on the bet that text repeats itself (code, quotes, lists, a model caught in a loop). It takes the place of
the engine's own in the real :class:`~minserve.engine.core.EngineCore`: the grader builds an engine with
``speculative_config={"method": "ngram", "num_speculative_tokens": k}`` and gives it
``LookupProposer(k)`` instead (``minserve.exercise_harness``). It is graded on its contract, checked on
every call the engine makes; on sequences whose tokens repeat; and on a repetitive workload run through the
real engine with the embedded model, ``minserve-tiny``: at least 60% of the drafts it proposes must be kept
and at least 30% of the output tokens must come from kept drafts (the engine's own prompt lookup keeps about
77% and gives 40%).

Part 2 is the verifier, for a batch of sequences at once. It is graded by exactness: on synthetic
distributions, tens of thousands of rows in one call, a chi-square test at significance 0.001 checks that
the tokens it emits at every position are distributed as the target's (whatever the draft distribution);
and by how many drafts it keeps. Then both halves run together in the real engine, greedy: the output must
be token for token what the engine gives without speculation.

Import only the standard library, ``torch`` and the sequence type below: the grader refuses a file that
imports anything else of minserve (whose ``engine.speculative`` holds a working proposer and verifier).
"""

from __future__ import annotations

import torch

from minserve.engine.sequence import Sequence

PLACEHOLDER = -1  # fills a row of verify's output past the tokens it emits (vLLM's placeholder id)

# --- part 1: the proposer -----------------------------------------------------------------------------------


class LookupProposer:
    """Drafts for running sequences, from their own tokens: the engine's ``Proposer`` interface
    (:class:`minserve.engine.speculative.proposer.Proposer`).

    The engine core builds one proposer, ``LookupProposer(k)``, and keeps it for its whole life. Before every
    step it calls :meth:`propose` with the sequences that are decoding; when a request ends (finished,
    cancelled or failed) it calls :meth:`release` with its sequence. Of a
    :class:`~minserve.engine.sequence.Sequence` you need only ``seq.token_ids`` (its prompt then its output
    so far; between two calls it only grows, by the tokens the last step kept) and ``seq.request_id`` (unique
    among the requests in flight). Add constructor arguments with defaults if your design has knobs.
    """

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens  # k: the core asks for at most this many drafts

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """For each sequence, up to ``num_tokens[i]`` draft tokens to follow ``seqs[i].token_ids``.

        What must hold: one list per sequence, in order, of ``int`` token ids, never longer than asked (an
        empty list, "decode this one plainly", is always allowed, and is the answer when 0 is asked); the
        sequences are left as they were. A draft is only worth its verification if the model keeps it:
        where a sequence's latest tokens appeared earlier in it, what followed them then is a good guess,
        and a guess that comes true should be as long as it is asked to be. What one sequence's tokens
        teach says nothing about another's. A step should not cost a scan of the whole sequence.
        """
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        """``seq`` has ended: forget whatever was kept for it, so memory does not grow with every request
        served (a proposer that keeps nothing per sequence has nothing to do here). A later sequence that
        reuses its request id is a new sequence."""
        raise NotImplementedError


# --- part 2: the verifier -----------------------------------------------------------------------------------


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The tokens each of ``B`` sequences emits this step, from its ``k`` drafts.

    ``draft_tokens`` ``[B, k]`` (int64): row b's drafts; ``draft_tokens[b, j]`` was drawn from
    ``draft_probs[b, j]``, ``[B, k, V]`` over the vocabulary (a proposer that does not sample, like part 1's,
    has a one-hot row there). ``target_probs`` ``[B, k + 1, V]``: row ``[b, j]`` is the distribution the
    target model would sample from after the sequence and its first ``j`` drafts, and row ``[b, k]`` the one
    after all of them. Rows sum to 1.

    Returns ``[B, k + 1]`` int64. Row b holds the drafts it keeps (a prefix of its drafts, in order, possibly
    empty), then exactly one token chosen with the target's distribution at that position, then
    :data:`PLACEHOLDER` to the end. So a step emits 1 … k + 1 tokens, never fewer than plain decoding.

    What must hold:

    - **exactness**: whatever the drafts and their distribution, the token a row emits at position ``j``
      is distributed as ``target_probs[b, j]``: the user gets what plain sampling from the target would have
      given, only sooner;
    - **keep as many drafts as exactness allows**: a draft the target would pick at least as often as the
      draft distribution did is always kept, and a row keeps its first draft as often as any exact verifier
      could (rejecting every draft is exact too, and useless);
    - a token the target gives probability 0 is never emitted;
    - every random number comes from ``generator`` (the same seed gives the same output), so a seeded
      request is reproducible;
    - shapes that do not fit together are a ``ValueError``.

    The grader calls it on tens of thousands of rows at once: work on whole tensors, not row by row.
    """
    raise NotImplementedError

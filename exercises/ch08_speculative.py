"""Chapter 08 exercise: the verification step of speculative decoding.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch08

A draft proposed ``k`` tokens. For each drafted position i you have the draft's distribution ``q_rows[i]``
(what the draft sampled token i from) and the target's distribution ``p_rows[i]`` (what the target model
would sample at that position); ``p_rows`` has one row more, ``p_rows[k]``, for the position after the last
draft. Distributions are lists of floats over the vocabulary (index = token id) that sum to 1.

The rule that keeps the output distributed exactly as the target's (Leviathan et al. 2023):

1. walk the drafts in order; accept draft x with probability min(1, p(x) / q(x));
2. at the first rejection, stop: emit a token sampled from the residual norm(max(p − q, 0)) at that position;
3. if every draft was accepted, emit one bonus token sampled from ``p_rows[k]``.

Draw every random number from the ``rng`` you are given (``rng.random()`` for the acceptance test,
:func:`sample` for a token), so a seeded run is reproducible. Use only the standard library.
"""

from __future__ import annotations

import random


def sample(probabilities: list[float], rng: random.Random) -> int:
    """A token id drawn from ``probabilities`` (given; use it for every token you sample)."""
    return rng.choices(range(len(probabilities)), weights=probabilities)[0]


def acceptance_probability(p_x: float, q_x: float) -> float:
    """The chance of accepting a drafted token that the target gives ``p_x`` and the draft gave ``q_x``.

    min(1, p_x / q_x); a token the draft could not have proposed (``q_x == 0``) is never accepted (return 0).
    """
    raise NotImplementedError


def residual(p: list[float], q: list[float]) -> list[float]:
    """norm(max(p − q, 0)): what to sample from after a rejection, as a distribution summing to 1.

    When nothing is left (p == q everywhere, so a rejection could not have happened but rounding made one),
    return ``p`` itself.
    """
    raise NotImplementedError


def verify(drafts: list[int], q_rows: list[list[float]], p_rows: list[list[float]], rng: random.Random) -> list[int]:
    """The tokens this step emits: the accepted drafts, then one token (a replacement or the bonus).

    Between 1 and ``len(drafts) + 1`` tokens. Raise ``ValueError`` unless ``len(q_rows) == len(drafts)`` and
    ``len(p_rows) == len(drafts) + 1``.
    """
    raise NotImplementedError

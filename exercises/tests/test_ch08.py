"""Graded tests for chapter 08 (``minserve grade ch08``). Each test's docstring is the hint a learner sees.

The verification step is graded on what it promises: the emitted tokens are distributed as the target's
samples. Each distribution test draws a few thousand steps with a seeded ``random.Random`` and applies a
chi-square test (:func:`minserve.quality.chi_square_test`) at significance 0.001, so a correct solution
fails by bad luck about once in a thousand seeds, and the seeds here are fixed. The mistakes that change the
distribution (sampling from p instead of the residual, accepting with q/p, taking the bonus from the wrong
row) move it far more than that; the ones that do not (an unnormalised residual, p/q unclipped) are caught
by the small tests of each function.
"""

from __future__ import annotations

import random

import pytest

from minserve.quality import chi_square_test

ALPHA = 1e-3
TRIALS = 3000


def _normalised(*weights: float) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


P = _normalised(1, 2, 3, 4, 2, 1)
Q = _normalised(5, 1, 1, 1, 3, 1)
DISJOINT_P, DISJOINT_Q = _normalised(0, 0, 0, 5, 3, 2), _normalised(6, 3, 1, 0, 0, 0)


def _first_tokens(exercise, p, q, k, seed):
    """Counts of the first emitted token over TRIALS steps, drafts sampled from q (p and q the same at every
    position, so every emitted token should be a sample from p)."""
    rng = random.Random(seed)
    counts = [0] * len(p)
    for _ in range(TRIALS):
        drafts = [exercise.sample(q, rng) for _ in range(k)]
        tokens = exercise.verify(drafts, [q] * k, [p] * (k + 1), rng)
        counts[tokens[0]] += 1
    return counts


@pytest.mark.points(1)
def test_acceptance_probability(exercise):
    """Accept with min(1, p/q): certain when the target likes the token at least as much as the draft did,
    p/q otherwise, and never for a token the draft gave probability 0."""
    assert exercise.acceptance_probability(0.5, 0.25) == pytest.approx(1.0)
    assert exercise.acceptance_probability(0.1, 0.4) == pytest.approx(0.25)
    assert exercise.acceptance_probability(0.3, 0.0) == 0.0


@pytest.mark.points(1)
def test_residual_is_normalised(exercise):
    """The residual is max(p − q, 0) divided by its sum, so it is a distribution (it sums to 1)."""
    assert exercise.residual([0.5, 0.3, 0.2], [0.2, 0.5, 0.3]) == pytest.approx([1.0, 0.0, 0.0])
    assert exercise.residual([0.4, 0.4, 0.2], [0.2, 0.2, 0.6]) == pytest.approx([0.5, 0.5, 0.0])


@pytest.mark.points(1)
def test_residual_when_nothing_is_left(exercise):
    """When p equals q there is nothing left over: return p, not a division by zero."""
    assert exercise.residual([0.25, 0.75], [0.25, 0.75]) == pytest.approx([0.25, 0.75])


@pytest.mark.points(1)
def test_verify_checks_its_arguments(exercise):
    """k drafts need k q rows and k + 1 p rows (the last one is for the bonus token)."""
    with pytest.raises(ValueError):
        exercise.verify([0, 1], [P, P], [P, P], random.Random(0))


@pytest.mark.points(1)
def test_verify_emits_between_one_and_k_plus_one_tokens(exercise):
    """A step emits the accepted drafts and then exactly one more token: at least 1, at most k + 1, and the
    accepted ones are the drafts, in order."""
    rng = random.Random(0)
    for _ in range(200):
        drafts = [exercise.sample(Q, rng) for _ in range(3)]
        tokens = exercise.verify(drafts, [Q] * 3, [P] * 4, rng)
        assert 1 <= len(tokens) <= 4
        assert tokens[:-1] == drafts[: len(tokens) - 1]


@pytest.mark.points(1)
def test_a_draft_equal_to_the_target_is_always_accepted(exercise):
    """When q equals p, min(1, p/q) is 1: every draft is accepted and the bonus comes after them."""
    rng = random.Random(0)
    drafts = [exercise.sample(P, rng) for _ in range(4)]
    assert len(exercise.verify(drafts, [P] * 4, [P] * 5, rng)) == 5


@pytest.mark.points(2)
@pytest.mark.parametrize("k", [1, 3])
def test_the_first_token_is_distributed_as_the_target(exercise, k):
    """The first emitted token must follow p exactly, whatever q is (chi-square test at 0.001). If this fails,
    check the acceptance test (min(1, p/q), not q/p) and that a rejection samples from the residual."""
    for seed in (1, 2):
        counts = _first_tokens(exercise, P, Q, k, seed)
        assert chi_square_test(counts, P, ALPHA).passed, f"counts {counts} against p = {P}"


@pytest.mark.points(2)
def test_disjoint_draft_and_target(exercise):
    """A draft that only proposes tokens the target never picks: every draft is rejected and the residual
    (p itself here) decides. No token outside p's support may ever come out."""
    counts = _first_tokens(exercise, DISJOINT_P, DISJOINT_Q, 2, seed=3)
    assert counts[:3] == [0, 0, 0]
    assert chi_square_test(counts, DISJOINT_P, ALPHA).passed, f"counts {counts}"


@pytest.mark.points(2)
def test_the_bonus_token_follows_the_next_distribution(exercise):
    """When every draft is accepted, the extra token is sampled from the last p row, the position after the
    drafts, not from the first."""
    rng = random.Random(4)
    bonus_p = _normalised(0, 1, 0, 0, 0, 3)
    counts = [0] * len(P)
    for _ in range(TRIALS):
        drafts = [exercise.sample(P, rng) for _ in range(2)]
        tokens = exercise.verify(drafts, [P, P], [P, P, bonus_p], rng)  # q = p: always all accepted
        counts[tokens[-1]] += 1
    assert chi_square_test(counts, bonus_p, ALPHA).passed, f"bonus counts {counts}"

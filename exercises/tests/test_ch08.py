"""Graded tests for chapter 08 (``minserve grade ch08``). Each test's docstring is the hint a learner sees.

The learner writes both halves of speculative decoding, and each is graded on what it does. The proposer:
its contract (checked on every call, in the real engine too), its guesses on sequences that repeat, its
state per sequence and after release, and the drafts the real engine keeps from it on a repetitive workload
(the engine's own verifier deciding, so only the proposer is measured). The verifier: its output's layout,
then exactness by a chi-square test (:func:`minserve.quality.chi_square_test`) at significance 0.001 of the
tokens it emits at every position against the target's distribution, on 20,000 rows of synthetic
distributions in one call, and how many drafts it keeps against the most an exact rule can keep. Every seed
is fixed, so a correct solution passes every run. Last, both halves in the real engine (``minserve-tiny``):
greedy output identical to the engine's without speculation, and sampled requests that run to their end.
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from minserve import exercise_harness as harness
from minserve.quality import chi_square_test

ALPHA = 1e-3
ROWS = 20_000
ENGINE = dict(num_threads=1)
# Prompts on which minserve-tiny falls into a loop, greedy: prompt lookup's best case, and a real one (a
# small model repeating itself, a list, a table, code).
LOOPS = [
    "red, green, blue, red, green, blue, red, green,",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "<tr><td>1</td></tr>\n<tr><td>2</td></tr>\n<tr><td>3</td></tr>\n",
    "import os\nimport sys\nimport os\nimport sys\nimport",
    "The module is a module. The module is a module. The module",
    "hello world\nhello world\nhello world\nhello world\n",
]
# Text that repeats less: drafts are kept and refused.
MIXED = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "Once upon a time there was a",
    "the same line of the same line of the same line of the",
]


@functools.cache
def _plain(prompts: tuple[str, ...], max_tokens: int) -> harness.SpeculativeRun:
    """The engine without speculation (the same for every learner: computed once)."""
    return harness.engine_run(prompts, max_tokens, **ENGINE)


def _random_rows(rows: int, vocab: int, seed: int, sharpness: float = 1.0) -> torch.Tensor:
    """``rows`` random distributions over ``vocab`` tokens (float64): the softmax of Gaussian logits, more
    peaked the larger ``sharpness``."""
    logits = sharpness * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.softmax(logits, dim=1)


def _normalised(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return w / w.sum()


def _assert_follows(out: torch.Tensor, target: torch.Tensor, positions: range) -> None:
    """At each position, the emitted tokens pass a chi-square test against that row of the target."""
    vocab = target.shape[-1]
    for j in positions:
        counts = harness.tokens_at(out, j, vocab)
        assert sum(counts) > 0, f"no row emitted a token at position {j}"
        result = chi_square_test(counts, target[j].tolist(), ALPHA)
        assert result.passed, f"position {j}: counts {counts} against p = {[round(x, 3) for x in target[j].tolist()]}"


# --- part 1: the proposer -----------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_proposals_keep_the_contract(exercise):
    """propose returns one list per sequence, in order, of int token ids, never longer than asked, and [] where
    0 is asked; it leaves the sequences as they were. release(seq) may be called for any sequence."""
    proposer = exercise.LookupProposer(3)
    assert proposer.num_speculative_tokens == 3
    seqs = [harness.stand_in_sequence(str(i), [7, 8, 9] * (i + 2)) for i in range(4)]
    for asked in ([3, 3, 3, 3], [1, 0, 2, 3], [0, 0, 0, 0]):
        drafts = proposer.propose(seqs, asked)
        harness.check_proposals(drafts, asked, vocab_size=10)
        assert [len(s.token_ids) for s in seqs] == [6, 9, 12, 15], "propose changed a sequence"
    for seq in seqs:
        proposer.release(seq)


@pytest.mark.points(2)
def test_a_repeating_sequence_is_continued(exercise):
    """Where a sequence's latest tokens appeared earlier, propose what followed them there: a sequence that
    repeats a pattern gets the pattern's next tokens, as many as asked; a loop shorter than what is asked
    goes on looping."""
    proposer = exercise.LookupProposer(3)
    pattern = harness.stand_in_sequence("a", [5, 6, 7, 8, 9] * 3 + [5, 6])
    short_loop = harness.stand_in_sequence("b", [3, 1, 4, 1, 5, 2, 0, 2, 0, 2])
    assert proposer.propose([pattern, short_loop], [3, 3]) == [[7, 8, 9], [0, 2, 0]]


@pytest.mark.points(2)
def test_each_sequence_keeps_its_own_state(exercise):
    """Sequences decoded side by side, step after step, each get drafts from their own tokens, also as they
    grow; a sequence released and replaced by a new one with the same request id starts afresh."""
    proposer = exercise.LookupProposer(2)
    first = harness.stand_in_sequence("r1", [10, 11, 12, 10, 11, 12, 10])
    second = harness.stand_in_sequence("r2", [20, 21, 20, 21, 20])
    assert proposer.propose([first, second], [2, 2]) == [[11, 12], [21, 20]]
    first.output_token_ids += [11, 12]  # the step kept both drafts
    second.output_token_ids += [22]  # this one's draft was refused: the model wrote 22
    assert proposer.propose([second, first], [2, 2])[1] == [10, 11]
    for _ in range(3):  # ... and the model goes on with a new pattern, 22 23 22 23 ...
        second.output_token_ids += [23, 22]
    assert proposer.propose([second], [2]) == [[23, 22]]
    proposer.release(second)
    fresh = harness.stand_in_sequence("r2", [30, 31, 32, 30])
    assert proposer.propose([fresh, first], [2, 2]) == [[31, 32], [10, 11]]


@pytest.mark.points(1)
def test_release_frees_what_was_kept(exercise):
    """After release(seq), nothing kept for seq stays in memory: an engine serves requests for weeks, and a
    proposer must not grow with every request it has seen."""
    tokens = [random.Random(i).choices(range(2048), k=1500) for i in range(20)]
    seqs = [harness.stand_in_sequence(f"m{i}", tokens[i]) for i in range(20)]
    proposer = exercise.LookupProposer(3)
    held, left = harness.bytes_held_then_left(
        propose=lambda: [proposer.propose([seq], [3]) for seq in seqs],
        release=lambda: [proposer.release(seq) for seq in seqs],
    )
    assert left <= max(64 * 1024, held // 4), f"{left / 1e6:.2f} MB still held of {held / 1e6:.2f} MB"


@pytest.mark.points(3)
def test_drafts_are_kept_on_a_repetitive_workload(exercise):
    """In the real engine (minserve-tiny, greedy, k = 3, the engine's own verifier), on prompts where the model
    loops: at least 60% of the drafts are kept, and at least 30% of the output tokens come from kept drafts
    (the engine's own prompt lookup: about 77% and 40%). Propose where the evidence is, as long as asked."""
    run = harness.engine_run(LOOPS, 32, exercise.LookupProposer, verify=None, k=3, **ENGINE)
    assert run.acceptance_rate >= 0.6, f"{run.acceptance_rate:.0%} of {run.num_draft_tokens} drafts kept"
    assert run.saved_share >= 0.3, f"{run.saved_share:.0%} of the output tokens came from kept drafts"


# --- part 2: the verifier -----------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_verify_output_layout(exercise):
    """verify returns int64 [B, k + 1]: the drafts kept, in order, then one token, then PLACEHOLDER (-1); shapes
    that do not fit together (k drafts need k draft rows and k + 1 target rows) are a ValueError."""
    q, p = _random_rows(3, 6, seed=1), _random_rows(4, 6, seed=2)
    out = harness.verify_rows(exercise.verify, q, p, 500, seed=3)
    assert out.dtype == torch.int64
    drafts, q_rows, p_rows = torch.zeros(2, 3, dtype=torch.long), q.expand(2, 3, 6), p.expand(2, 4, 6)
    for bad in ((q_rows, p_rows[:, :3]), (q_rows[:, :2], p_rows), (q_rows[:1], p_rows[:1])):
        with pytest.raises(ValueError):
            exercise.verify(drafts, *bad, torch.Generator().manual_seed(0))


@pytest.mark.points(1)
def test_a_draft_the_target_likes_as_much_is_always_kept(exercise):
    """A draft the target would pick at least as often as the draft distribution did is always kept: with
    q = p every row keeps all k drafts and adds the bonus token; a greedy target (one-hot) keeps a draft
    exactly when it is the target's choice."""
    p = _random_rows(4, 6, seed=4)
    out = harness.verify_rows(exercise.verify, p[:3], p, 2000, seed=5)
    assert bool((out != harness.PLACEHOLDER).all()), "a draft drawn from the target itself was refused"
    target = torch.nn.functional.one_hot(torch.tensor([2, 4, 1, 3]), 6).double().expand(4, 4, 6)
    drafts = torch.tensor([[2, 4, 1], [2, 4, 5], [2, 0, 1], [1, 4, 1]])
    out = exercise.verify(drafts, torch.nn.functional.one_hot(drafts, 6).double(), target, None)
    assert out.tolist() == [[2, 4, 1, 3], [2, 4, 1, -1], [2, 4, -1, -1], [2, -1, -1, -1]]


@pytest.mark.points(1)
def test_never_emits_a_token_the_target_rules_out(exercise):
    """A token the target gives probability 0 at a position is never emitted there, even when the draft
    proposes it often."""
    p = torch.stack([_normalised(0, 3, 0, 5, 2, 0)] * 4)
    q = torch.stack([_normalised(4, 1, 4, 1, 1, 4)] * 3)
    out = harness.verify_rows(exercise.verify, q, p, 5000, seed=6)
    for j in range(4):
        counts = harness.tokens_at(out, j, 6)
        assert counts[0] == counts[2] == counts[5] == 0, f"position {j}: {counts}"


@pytest.mark.points(4)
@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_the_target(exercise, k):
    """Exactness: at every position the emitted tokens are distributed as the target's row there, whatever q
    is (chi-square test at 0.001 on 20,000 rows, two seeds). If this fails, check when you accept, and what
    a rejected position is replaced with: it must make up exactly what accepting left out."""
    for seed in (10, 20):
        p, q = _random_rows(k + 1, 8, seed), _random_rows(k, 8, seed + 1)
        out = harness.verify_rows(exercise.verify, q, p, ROWS, seed=seed + 2)
        _assert_follows(out, p, range(k + 1))


@pytest.mark.points(2)
def test_disjoint_draft_and_target(exercise):
    """A draft that only proposes tokens the target never picks: every draft is refused, and what comes out
    in its place still follows the target."""
    p = torch.stack([_normalised(0, 0, 0, 5, 3, 2)] * 3)
    q = torch.stack([_normalised(6, 3, 1, 0, 0, 0)] * 2)
    out = harness.verify_rows(exercise.verify, q, p, ROWS, seed=30)
    assert bool((out[:, 1:] == harness.PLACEHOLDER).all()), "a draft the target rules out was kept"
    _assert_follows(out, p, range(1))


@pytest.mark.points(2)
def test_the_bonus_token_follows_the_next_distribution(exercise):
    """When every draft is kept, one more token comes from the target's row after the last draft (row k),
    not from an earlier row."""
    p = torch.cat([_random_rows(2, 6, seed=40), _normalised(0, 1, 0, 0, 0, 3)[None]])
    out = harness.verify_rows(exercise.verify, p[:2], p, ROWS, seed=41)  # q = p: every draft kept
    _assert_follows(out, p, range(3))


@pytest.mark.points(2)
def test_keeps_as_many_drafts_as_exactness_allows(exercise):
    """The share of rows that keep their first draft must be the most any exact verifier can keep: refusing
    drafts the target would have accepted wastes the step, keeping more than that changes the output."""
    for seed, sharpness in ((50, 1.0), (60, 3.0)):
        p, q = _random_rows(4, 10, seed, sharpness), _random_rows(3, 10, seed + 1, sharpness)
        out = harness.verify_rows(exercise.verify, q, p, ROWS, seed=seed + 2)
        kept = float((out[:, 1] != harness.PLACEHOLDER).double().mean())
        best = float(torch.minimum(p[0], q[0]).sum())
        tolerance = 5 * math.sqrt(best * (1 - best) / ROWS)  # five standard errors of a share of ROWS rows
        assert abs(kept - best) <= tolerance, f"{kept:.3f} of rows kept their first draft; the most is {best:.3f}"


@pytest.mark.points(1)
def test_the_generator_makes_it_reproducible(exercise):
    """Every random number comes from the generator passed in: the same seed gives the same output, another
    seed another one."""
    q, p = _random_rows(3, 8, seed=70), _random_rows(4, 8, seed=71)
    first = harness.verify_rows(exercise.verify, q, p, 2000, seed=72)
    torch.manual_seed(123)  # the global generator moves on; the one passed in does not
    torch.rand(10)
    assert torch.equal(first, harness.verify_rows(exercise.verify, q, p, 2000, seed=72))
    assert not torch.equal(first, harness.verify_rows(exercise.verify, q, p, 2000, seed=73))


# --- both, in the real engine -------------------------------------------------------------------------------


@pytest.mark.points(4)
def test_greedy_output_is_plain_greedy_output(exercise):
    """Your proposer and verifier in the real engine (minserve-tiny, greedy, k = 3 and k = 5): the tokens are
    exactly the engine's without speculation, and some drafts were kept and some refused. A greedy target is
    one-hot at its choice; a draft that is not that choice must never be kept."""
    for prompts, k in ((MIXED, 3), (LOOPS, 5)):
        run = harness.engine_run(prompts, 24, exercise.LookupProposer, exercise.verify, k=k, **ENGINE)
        assert run.tokens == _plain(tuple(prompts), 24).tokens, f"k = {k}: greedy output changed"
        assert 0 < run.num_accepted_tokens < run.num_draft_tokens, (run.num_accepted_tokens, run.num_draft_tokens)


@pytest.mark.points(1)
def test_sampled_requests_run_through_your_verifier(exercise):
    """Sampled requests (temperature 0.8, seeded) through your proposer and verifier in the real engine: the
    engine hands verify float32 rows over its whole vocabulary (2048 tokens) and one request's generator;
    every request runs to its length, drafts are kept, and the same seeds give the same tokens."""
    runs = [harness.engine_run(LOOPS, 24, exercise.LookupProposer, exercise.verify, 3, 0.8, **ENGINE) for _ in "ab"]
    assert runs[0].num_accepted_tokens > 0
    assert runs[0].tokens == runs[1].tokens

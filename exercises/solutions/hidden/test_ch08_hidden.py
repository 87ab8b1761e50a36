"""Chapter 08's hidden tests (``minserve grade ch08 --hidden``): the public tests' measures on other shapes,
seeds, vocabularies and workloads, so a file fitted to the public tests does not pass these. Instructors
only: this file sits under ``exercises/solutions/``, which the learner's copy of the course never holds.

The acceptance bounds are the reference design's and the engine's own prompt lookup's with a margin of
about a quarter, so another sound design passes; the distribution tests are chi-square tests at 0.001 with
fixed seeds.
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
ENGINE = dict(num_threads=1)
LOOPS = [
    "a, b, c, a, b, c, a, b, c, a,",
    "x = 0\nx = 0\nx = 0\nx = 0\n",
    "- item\n- item\n- item\n- item\n-",
    "Monday, Tuesday, Monday, Tuesday, Monday,",
    "SELECT * FROM t;\nSELECT * FROM t;\nSELECT",
    "la la la la la la la",
]
MIXED = [
    "def quicksort(items):\n    if len(items) <= 1:",
    "import numpy as np\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "return None\nreturn None\nreturn",
]


@functools.cache
def _plain(prompts: tuple[str, ...], max_tokens: int, **options: int) -> harness.SpeculativeRun:
    return harness.engine_run(prompts, max_tokens, **ENGINE, **options)


def _random_rows(rows: int, vocab: int, seed: int, sharpness: float = 1.0) -> torch.Tensor:
    logits = sharpness * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.softmax(logits, dim=1)


def _assert_follows(out: torch.Tensor, target: torch.Tensor, positions: range) -> None:
    vocab = target.shape[-1]
    for j in positions:
        counts = harness.tokens_at(out, j, vocab)
        assert sum(counts) > 0, f"no row emitted a token at position {j}"
        assert chi_square_test(counts, target[j].tolist(), ALPHA).passed, f"position {j}: counts {counts}"


def _periodic(request_id: str, period: list[int], length: int) -> harness.EngineSequence:
    return harness.stand_in_sequence(request_id, [period[i % len(period)] for i in range(length)])


# --- the proposer -------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_contract_and_continuations_at_another_k(exercise):
    """k = 5, five sequences asked for 5, 0, 1, 4 and 2 drafts: the contract holds, each repeating sequence is
    continued, and a loop of three tokens goes on for all five drafts."""
    proposer = exercise.LookupProposer(5)
    assert proposer.num_speculative_tokens == 5
    periods = [[40, 41, 42, 43, 44, 45, 46], [7, 8, 9], [100, 101, 102, 103], [3, 1, 4], [60, 61, 62, 63, 64]]
    seqs = [_periodic(f"s{i}", period, 3 * len(period) + 1) for i, period in enumerate(periods)]
    asked = [5, 0, 1, 4, 2]
    drafts = proposer.propose(seqs, asked)
    harness.check_proposals(drafts, asked, vocab_size=200)
    expected = [[period[(len(seq.token_ids) + i) % len(period)] for i in range(n)] for seq, period, n in
                zip(seqs, periods, asked)]  # fmt: skip
    assert drafts == expected
    assert proposer.propose([seqs[1]], [5]) == [[8, 9, 7, 8, 9]]


@pytest.mark.points(2)
def test_many_sequences_growing_side_by_side(exercise):
    """Six sequences, each with its own pattern, grow over ten steps in batches of changing order and size:
    every proposal follows its own sequence; released ids reused by new sequences start afresh."""
    proposer = exercise.LookupProposer(3)
    periods = {f"q{i}": [10 * i + j for j in range(2 + i)] for i in range(6)}
    seqs = {name: _periodic(name, period, 2 * len(period)) for name, period in periods.items()}
    rng = random.Random(7)
    for _ in range(10):
        batch = rng.sample(sorted(seqs), rng.randint(1, 6))
        drafts = proposer.propose([seqs[name] for name in batch], [3] * len(batch))
        for name, draft in zip(batch, drafts):
            seq, period = seqs[name], periods[name]
            assert draft == [period[(len(seq.token_ids) + i) % len(period)] for i in range(3)], name
            kept = rng.randint(0, 3)  # the step kept some drafts, then the model's own token
            seq.output_token_ids += [period[(len(seq.token_ids) + i) % len(period)] for i in range(kept + 1)]
    for name in ("q0", "q3"):
        proposer.release(seqs[name])
        seqs[name] = harness.stand_in_sequence(name, [90, 91, 92, 93, 90])
    assert proposer.propose([seqs["q0"], seqs["q3"]], [3, 2]) == [[91, 92, 93], [91, 92]]


@pytest.mark.points(1)
def test_release_frees_longer_sequences(exercise):
    """Ten sequences of 3000 random tokens each, released: nothing kept for them stays in memory."""
    seqs = [harness.stand_in_sequence(f"m{i}", random.Random(100 + i).choices(range(2048), k=3000)) for i in range(10)]
    proposer = exercise.LookupProposer(4)
    held, left = harness.bytes_held_then_left(
        propose=lambda: proposer.propose(seqs, [4] * len(seqs)),
        release=lambda: [proposer.release(seq) for seq in seqs],
    )
    assert left <= max(64 * 1024, held // 4), f"{left / 1e6:.2f} MB still held of {held / 1e6:.2f} MB"


@pytest.mark.points(3)
def test_drafts_are_kept_on_another_repetitive_workload(exercise):
    """Other looping prompts, k = 4, 40 tokens, the engine's verifier: at least 50% of the drafts kept and at
    least 35% of the output tokens from kept drafts (the engine's prompt lookup: about 72% and 52%)."""
    run = harness.engine_run(LOOPS, 40, exercise.LookupProposer, verify=None, k=4, **ENGINE)
    assert run.acceptance_rate >= 0.5, f"{run.acceptance_rate:.0%} of {run.num_draft_tokens} drafts kept"
    assert run.saved_share >= 0.35, f"{run.saved_share:.0%} of the output tokens came from kept drafts"


# --- the verifier -------------------------------------------------------------------------------------------


@pytest.mark.points(4)
@pytest.mark.parametrize("k, vocab, sharpness", [(2, 50, 2.0), (5, 12, 1.0)])
def test_exactness_on_other_shapes(exercise, k, vocab, sharpness):
    """Every position follows the target on a 50-token vocabulary with peaked rows (k = 2) and with k = 5."""
    p, q = _random_rows(k + 1, vocab, 80 + k, sharpness), _random_rows(k, vocab, 90 + k, sharpness)
    out = harness.verify_rows(exercise.verify, q, p, 30_000, seed=k)
    _assert_follows(out, p, range(k + 1))


@pytest.mark.points(3)
def test_each_row_uses_its_own_distributions(exercise):
    """A batch whose rows have different target and draft distributions (two groups): each group's tokens
    follow its own target, at every position."""
    half, k, vocab = 10_000, 2, 6
    p_a, q_a = _random_rows(k + 1, vocab, 11), _random_rows(k, vocab, 12)
    p_b, q_b = _random_rows(k + 1, vocab, 13, 2.0), _random_rows(k, vocab, 14, 2.0)
    p = torch.cat([p_a.expand(half, -1, -1), p_b.expand(half, -1, -1)])
    q = torch.cat([q_a.expand(half, -1, -1), q_b.expand(half, -1, -1)])
    out = harness.verify_rows(exercise.verify, q, p, 2 * half, seed=15)
    _assert_follows(out[:half], p_a, range(k + 1))
    _assert_follows(out[half:], p_b, range(k + 1))


@pytest.mark.points(1)
def test_a_draft_almost_equal_to_the_target(exercise):
    """q equal to p but for rounding (1e-12 apart): nearly every draft is kept, nothing breaks (no NaN, no
    division by a residual of almost nothing), and the output still follows p."""
    p = _random_rows(4, 8, 21)
    q = p[:3] + 1e-12 * torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    out = harness.verify_rows(exercise.verify, q / q.sum(dim=1, keepdim=True), p, 10_000, seed=22)
    _assert_follows(out, p, range(4))


@pytest.mark.points(2)
def test_keeps_as_many_drafts_at_every_position(exercise):
    """The first draft is kept as often as any exact verifier can, and so is the second among the rows that
    kept the first."""
    rows = 30_000
    p, q = _random_rows(3, 16, 31, 1.5), _random_rows(2, 16, 32, 1.5)
    out = harness.verify_rows(exercise.verify, q, p, rows, seed=33)
    kept_first = out[:, 1] != harness.PLACEHOLDER
    kept_second = (out[:, 2] != harness.PLACEHOLDER)[kept_first]
    for kept, j in ((kept_first, 0), (kept_second, 1)):
        best = float(torch.minimum(p[j], q[j]).sum())
        share = float(kept.double().mean())
        assert abs(share - best) <= 5 * math.sqrt(best * (1 - best) / len(kept)), (j, share, best)


# --- both, in the real engine -------------------------------------------------------------------------------


@pytest.mark.points(4)
def test_greedy_identity_with_other_prompts_and_preemption(exercise):
    """Other prompts, k = 2 and k = 4, in an engine short of KV memory (blocks of 4, 14 of them, 3 seats, a
    budget of 16 tokens: chunking and preempting): greedy outputs equal the engine's without speculation."""
    prompts = tuple(MIXED + LOOPS[:2])
    small = dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    expected = _plain(prompts, 16, **small)
    assert expected.num_preemptions > 0
    for k in (2, 4):
        run = harness.engine_run(prompts, 16, exercise.LookupProposer, exercise.verify, k, **ENGINE, **small)
        assert run.tokens == expected.tokens, f"k = {k}: greedy output changed"
        assert 0 < run.num_accepted_tokens < run.num_draft_tokens

"""Chapter 03's hidden tests: other shapes, seeds, scales and prompts than the public ones, the same claims.

An instructor keeps this file apart from the learner's copy (``minserve grade --export-student`` leaves it
out); ``minserve grade ch03 --hidden`` runs it.
"""

from __future__ import annotations

import math

import pytest
import torch

from minserve import exercise_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H200 = (989e12, 4.8e12)


@pytest.mark.points(2)
@pytest.mark.parametrize(
    ("contexts", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [([64, 1, 33, 100, 7], 8, 1, 16, 4), ([2, 129], 6, 3, 32, 32), ([48, 17, 16], 8, 2, 64, 16)],
    ids=["mqa-8-heads-blocks-of-4", "groups-of-2-blocks-of-32", "full-and-partial-blocks"],
)
def test_hidden_paged_shapes(exercise, contexts, num_heads, num_kv_heads, head_dim, block_size):
    """Other groupings, head sizes, block sizes and context lengths: the same softmax over each context."""
    case = exercise_attention.paged_case(contexts, num_heads, num_kv_heads, head_dim, block_size, seed=11,
                                         device=DEVICE)  # fmt: skip
    exercise_attention.assert_attends(exercise.paged_decode_attention, case, 1e-4)


@pytest.mark.points(2)
def test_hidden_bfloat16_long_context(exercise):
    """A bfloat16 cache over contexts of many blocks, with a scale of its own."""
    case = exercise_attention.paged_case([90, 31, 1], 4, 2, 32, 8, dtype=torch.bfloat16, seed=12, device=DEVICE)
    case = exercise_attention.PagedCase(case.query, case.kv_cache, case.block_tables, case.context_lens, 0.05)
    exercise_attention.assert_attends(exercise.paged_decode_attention, case, 2e-2)


@pytest.mark.points(3)
def test_hidden_plugged_into_the_engine(exercise):
    """Other prompts, decoded far enough to cross block boundaries: the engine's greedy tokens unchanged."""
    prompts = ("Three things to pack for a hike:", "import os\n\n\ndef walk(path):")
    mine, calls = exercise_attention.greedy_tokens(exercise.paged_decode_attention, prompts, 20)
    reference, _ = exercise_attention.greedy_tokens(None, prompts, 20)
    assert calls > 0 and mine == reference


@pytest.mark.points(2)
def test_hidden_roofline_on_an_h200(exercise):
    """Part 1 on other numbers: an H200's ridge point and a decode step of a 70B model in fp8."""
    assert exercise.ridge_point(*H200) == pytest.approx(989e12 / 4.8e12)
    step = exercise.decode_step_time_s(70e9, 8, 4096, 163_840, *H200, bytes_per_weight=1)
    assert step == pytest.approx(max(2 * 70e9 * 8 / 989e12, (70e9 + 8 * 4096 * 163_840) / 4.8e12))
    assert math.isclose(exercise.critical_batch_size(*H200, bytes_per_weight=1), 989e12 / 4.8e12 / 2)

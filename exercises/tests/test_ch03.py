"""Graded tests for chapter 03 (``minserve grade ch03``). Each test's docstring is the hint a learner sees.

Part 1 checks the roofline arithmetic on hand-worked numbers (the published H100 and H200 roofs among them)
and, with hypothesis, against :mod:`minserve.capacity.roofline`. Part 2 runs the learner's paged decode
attention on random decode steps in the engine's cache layout (:mod:`minserve.exercise_attention`: blocks in
random places, every slot no sequence owns set to NaN) against a float64 reference, and then inside the
engine itself. Without a CUDA GPU the kernel runs under Triton's interpreter on the CPU (the grader's child
process sets ``TRITON_INTERPRET=1`` before triton is imported), so the shapes stay small. Tolerances:
float32 within 1e-4 of float64; a 16-bit cache within 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import exercise_attention
from minserve.capacity import roofline

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H100 = (989e12, 3.35e12)  # dense bf16 FLOP/s, bytes/s
H200 = (989e12, 4.8e12)
PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
POSITIVE = st.floats(1e-3, 1e18, allow_nan=False, allow_infinity=False)


def _case(*args, **options):
    """:func:`minserve.exercise_attention.paged_case` on the device the kernel runs on."""
    return exercise_attention.paged_case(*args, device=DEVICE, **options)


# --- part 1: the roofline by hand --------------------------------------------------------------------------


@pytest.mark.points(2)
def test_matmul_intensity_by_hand(exercise):
    """FLOPs are 2·m·n·k; bytes are (m·k + k·n + m·n) elements, each read or written once. A square 1024
    matmul in bf16 has 2·1024³ / (3·1024²·2) = 341.3 FLOP/byte; one token times a weight matrix about 1."""
    assert exercise.matmul_intensity(1024, 1024, 1024) == pytest.approx(1024 / 3)
    assert exercise.matmul_intensity(1024, 1024, 1024, bytes_per_element=4) == pytest.approx(512 / 3)
    gemv = exercise.matmul_intensity(1, 4096, 4096)
    assert 0.99 < gemv < 1.0
    assert exercise.matmul_intensity(2, 3, 5) == pytest.approx(2 * 2 * 3 * 5 / ((2 * 5 + 5 * 3 + 2 * 3) * 2))


@pytest.mark.points(1)
def test_ridge_point_of_published_gpus(exercise):
    """The ridge point is peak FLOP/s divided by bandwidth in bytes/s: 989e12 / 3.35e12 ≈ 295 for an H100."""
    assert exercise.ridge_point(*H100) == pytest.approx(295.22, abs=0.01)
    assert exercise.ridge_point(*H200) == pytest.approx(206.04, abs=0.01)
    assert exercise.ridge_point(100.0, 10.0) == 10


@pytest.mark.points(2)
def test_roofline_time_and_bound_by_hand(exercise):
    """Time is max(FLOPs / peak, bytes / bandwidth); the work is memory-bound when the bytes take longer,
    compute-bound otherwise (a tie counts as compute)."""
    # A toy machine: 100 FLOP/s, 10 bytes/s.
    assert exercise.roofline_time_s(1000, 50, 100, 10) == 10  # compute: 10 s against 5 s
    assert exercise.roofline_time_s(100, 50, 100, 10) == 5  # memory: 1 s against 5 s
    assert exercise.bound(1000, 50, 100, 10) == "compute"
    assert exercise.bound(100, 50, 100, 10) == "memory"
    assert exercise.bound(500, 50, 100, 10) == "compute"  # 5 s each: a tie
    # The same on an H100: a 1 GFLOP piece of work moving 1 GB is memory-bound.
    assert exercise.roofline_time_s(1e9, 1e9, *H100) == pytest.approx(1e9 / 3.35e12)
    assert exercise.bound(1e9, 1e9, *H100) == "memory"


@pytest.mark.points(1)
def test_roofline_refuses_roofs_that_are_not_positive(exercise):
    """A peak or a bandwidth of zero (or less) is a mistake, not a machine: raise ValueError."""
    for peak, bandwidth in [(0.0, 1e12), (1e12, 0.0), (-1.0, 1e12)]:
        with pytest.raises(ValueError):
            exercise.roofline_time_s(1e9, 1e9, peak, bandwidth)
        with pytest.raises(ValueError):
            exercise.ridge_point(peak, bandwidth)


@pytest.mark.points(1)
@PROPERTY
@given(POSITIVE, POSITIVE, POSITIVE, POSITIVE)
def test_roofline_agrees_with_minserve(exercise, flops, bytes_moved, peak, bandwidth):
    """roofline_time_s and bound must agree with minserve.capacity.roofline.predict on any positive numbers:
    time is the larger of the two times, and the bound names the larger one."""
    hw = roofline.Hardware("random", peak, bandwidth, memory_bytes=1)
    expected = roofline.predict(flops, bytes_moved, hw)
    assert exercise.roofline_time_s(flops, bytes_moved, peak, bandwidth) == pytest.approx(expected.time_s)
    assert exercise.bound(flops, bytes_moved, peak, bandwidth) == expected.bound


@pytest.mark.points(2)
def test_critical_batch_size(exercise):
    """Decode does 2·B FLOPs per weight read, so its intensity is 2·B / bytes_per_weight; the critical batch
    is where that reaches the ridge: ridge × bytes_per_weight / 2. In bf16: H100 ≈ 295, H200 ≈ 206."""
    assert round(exercise.critical_batch_size(*H100)) == 295
    assert round(exercise.critical_batch_size(*H200)) == 206
    # fp8 weights (1 byte) halve the bytes per FLOP, so half the batch already reaches the ridge.
    assert exercise.critical_batch_size(*H100, bytes_per_weight=1) == pytest.approx(989e12 / 3.35e12 / 2)
    assert exercise.critical_batch_size(*H100, bytes_per_weight=4) == pytest.approx(2 * 989e12 / 3.35e12)


@pytest.mark.points(2)
def test_attention_intensity(exercise):
    """In 16-bit, attention's intensity is S·T / (S + T): decode (T = 1) stays just under 1 at any context,
    a prefill of S tokens reaches S / 2. With b bytes per element multiply by 2 / b."""
    assert exercise.attention_intensity(1, 4096) == pytest.approx(4096 / 4097)
    assert exercise.attention_intensity(1, 10**6) < 1
    assert exercise.attention_intensity(4096, 4096) == pytest.approx(2048)
    assert exercise.attention_intensity(16, 4096) == pytest.approx(16 * 4096 / 4112)
    assert exercise.attention_intensity(512, 512, bytes_per_element=4) == pytest.approx(128)
    for t, s in [(1, 128), (7, 300), (512, 512)]:  # the same as minserve's, with one query head per KV head
        assert exercise.attention_intensity(t, s) == pytest.approx(roofline.attention_intensity_flops_per_byte(t, s))


@pytest.mark.points(2)
def test_decode_step_of_an_8b_model(exercise):
    """Bytes are params × bytes_per_weight (once for the whole batch) + batch × context × KV bytes per token;
    FLOPs are 2 × params × batch. An 8B model at batch 1 reads 16 GB: about 4.9 ms on an H100."""
    params, kv = 8e9, 131_072  # Llama-3-8B's KV bytes per token in bf16
    one = exercise.decode_step_time_s(params, 1, 2048, kv, *H100)
    assert one == pytest.approx((16e9 + 2048 * kv) / 3.35e12)  # memory-bound
    # Batch 512 at a short context: the FLOPs (8.19e15 / 989e12 = 8.3 ms) outweigh the bytes (7.3 ms).
    many = exercise.decode_step_time_s(params, 512, 128, kv, *H100)
    assert many == pytest.approx(2 * params * 512 / 989e12)
    # KV in fp8 at batch 64 and context 8192: 16e9 + 64 · 8192 · 65,536 bytes.
    fp8_kv = exercise.decode_step_time_s(params, 64, 8192, kv / 2, *H100)
    assert fp8_kv == pytest.approx((16e9 + 64 * 8192 * kv / 2) / 3.35e12)
    assert exercise.decode_step_time_s(params, 1, 2048, kv, *H100, bytes_per_weight=1) < one


# --- part 2: paged decode attention in Triton ----------------------------------------------------------------

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")


@pytest.mark.points(4)
def test_paged_decode_matches_float64(exercise):
    """Four sequences of 1, 16, 37 and 5 tokens (a context of one, a full last block, a partial one), 4 query
    heads over 2 KV heads, blocks of 16 in random places: each output row is softmax(scale · q Kᵀ) V over
    exactly its own context, within 1e-4 of float64."""
    exercise_attention.assert_attends(
        exercise.paged_decode_attention, _case([1, 16, 37, 5], 4, 2, 32, 16, seed=1), 1e-4
    )


@pytest.mark.points(1)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa-2", "mqa"])
def test_grouped_query_heads(exercise, num_kv_heads):
    """Query head h reads KV head h // (num_heads // num_kv_heads): one KV head per query head, one per two,
    and one for all four (multi-query)."""
    case = _case([9, 20], 4, num_kv_heads, 32, 8, seed=num_kv_heads)
    exercise_attention.assert_attends(exercise.paged_decode_attention, case, 1e-4)


@pytest.mark.points(1)
@pytest.mark.parametrize(
    ("contexts", "block_size", "head_dim"),
    [([100, 3], 8, 16), ([70, 64, 2], 32, 64)],
    ids=["blocks-of-8", "blocks-of-32"],
)
def test_block_sizes_and_long_contexts(exercise, contexts, block_size, head_dim):
    """Contexts of many blocks (13 blocks of 8; three of 32) and other head sizes: the walk over a sequence's
    blocks follows its table to the end of its context, whatever the block size."""
    case = _case(contexts, 4, 2, head_dim, block_size, seed=block_size)
    exercise_attention.assert_attends(exercise.paged_decode_attention, case, 1e-4)


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16bit_cache(exercise, dtype):
    """A 16-bit query and cache: load, widen to float32 (.to(tl.float32)) before the dot products and the
    softmax, and store the output in the query's dtype."""
    case = _case([33, 7], 4, 2, 32, 16, dtype=dtype, seed=3)
    exercise_attention.assert_attends(exercise.paged_decode_attention, case, 2e-2)


@pytest.mark.points(1)
def test_edge_cases(exercise):
    """A new output tensor, the inputs untouched, an empty batch answered with an empty tensor, and a
    ValueError when num_heads is not a multiple of num_kv_heads."""
    case = _case([5], 4, 2, 16, 8)
    out = exercise_attention.attend(exercise.paged_decode_attention, case)
    assert out.data_ptr() != case.query.data_ptr()
    empty = _case([], 4, 2, 16, 8)
    assert exercise_attention.attend(exercise.paged_decode_attention, empty).shape == (0, 4, 16)
    wrong = _case([5], 3, 2, 16, 8)
    with pytest.raises(ValueError):
        exercise_attention.attend(exercise.paged_decode_attention, wrong)


@pytest.mark.points(4)
def test_plugged_into_the_engine(exercise):
    """minserve-tiny decodes three prompts 12 tokens each with your function as the attention of every decode
    step (4 query heads over 2 KV heads, blocks of 16, the engine's own block tables): its greedy tokens must
    equal those of the engine's own torch attention."""
    mine, calls = exercise_attention.greedy_tokens(exercise.paged_decode_attention, PROMPTS, 12)
    reference, _ = exercise_attention.greedy_tokens(None, PROMPTS, 12)
    assert calls > 0, "the engine never called paged_decode_attention"
    assert mine == reference, "greedy tokens differ from the engine's own attention"

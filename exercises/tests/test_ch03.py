"""Graded tests for chapter 03 (``minserve grade ch03``). Each test's docstring is the hint a learner sees.

Part 1 checks the roofline arithmetic on hand-worked numbers (the published H100 and H200 roofs among them)
and, with hypothesis, against :mod:`minserve.capacity.roofline`. Part 2 runs the learner's Triton kernels:
launched directly, with a grid the test chooses, and through the learner's launchers, against torch on sizes
that are not a multiple of the block. Without a CUDA GPU they run under Triton's interpreter on the CPU
(the grader's child process sets ``TRITON_INTERPRET=1`` before triton is imported), so the shapes stay
small. Tolerances: float32 agrees to 1e-5; a 16-bit result may differ from float32 arithmetic rounded once
by about one unit in the last place.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.capacity import roofline

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H100 = (989e12, 3.35e12)  # dense bf16 FLOP/s, bytes/s
H200 = (989e12, 4.8e12)
PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
POSITIVE = st.floats(1e-3, 1e18, allow_nan=False, allow_infinity=False)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 4e-2), torch.float16: (2e-3, 4e-3)}


def _random(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def _rms_norm_reference(x, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def _assert_close(actual, expected):
    rtol, atol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


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


# --- part 2: Triton ----------------------------------------------------------------------------------------


def _padded(n, pad, fill=None, seed=0):
    """``n`` elements (random, or ``fill``) at the start of a buffer ``pad`` elements longer, and the padding.

    A kernel that forgets a mask reads and writes past its tensor's end. On a GPU that is an illegal memory
    access; under the interpreter it scribbles over the CPU's heap and can crash the whole grading run. Inside
    a padded buffer the stray accesses land in memory the test owns, where it can see them and say so.
    """
    buffer = _random(n + pad, seed=seed) if fill is None else torch.full((n + pad,), fill, device=DEVICE)
    return buffer[:n], buffer[n:]


def _checked_add(exercise, n=1000, block=256):
    """Launch add_kernel directly over padded buffers; fail clearly if it wrote past ``n``."""
    (x, _), (y, _) = _padded(n, block, seed=1), _padded(n, block, seed=2)
    out, spare = _padded(n, block, fill=math.nan)
    exercise.add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    if not spare.isnan().all():
        pytest.fail("add_kernel wrote past n_elements: give tl.store the mask (offsets < n_elements)")
    return x, y, out


def _checked_rms_norm(exercise, rows=5, n_cols=40, block=64, eps=1e-6):
    """Launch rms_norm_kernel directly over a padded buffer; fail clearly if it wrote past the last row."""
    flat_x, _ = _padded(rows * n_cols, block, seed=5)
    flat_out, spare = _padded(rows * n_cols, block, fill=math.nan)
    x, out, weight = flat_x.view(rows, n_cols), flat_out.view(rows, n_cols), _random(n_cols, seed=6)
    exercise.rms_norm_kernel[(rows,)](x, weight, out, n_cols, eps, BLOCK=block)
    if not spare.isnan().all():
        pytest.fail("rms_norm_kernel wrote past the end of its row: give tl.store the mask (cols < n_cols)")
    return x, weight, out


@pytest.mark.points(3)
def test_add_kernel_launched_directly(exercise):
    """add_kernel: offsets = program_id(0) · BLOCK + arange(0, BLOCK), mask = offsets < n_elements, and both
    tl.load and tl.store take the mask. Here 1000 elements run as 4 programs of 256; the last is partly full."""
    x, y, out = _checked_add(exercise)
    torch.testing.assert_close(out, x + y)


@pytest.mark.points(1)
@pytest.mark.parametrize("n", [1, 1000, 1025, 4099])
def test_vector_add_ragged_sizes(exercise, n):
    """vector_add launches triton.cdiv(n, BLOCK) programs of add_kernel, so sizes that are not a multiple of
    the block still cover every element."""
    _checked_add(exercise)  # a kernel without its masks would write past small tensors' ends
    x, y = _random(n, seed=n), _random(n, seed=n + 1)
    _assert_close(exercise.vector_add(x, y), x + y)


@pytest.mark.points(1)
def test_vector_add_edge_cases(exercise):
    """vector_add returns a new tensor and leaves its inputs alone, returns an empty tensor for empty inputs
    (launching nothing), and raises ValueError for tensors of different shapes."""
    _checked_add(exercise)
    x, y = _random(37, seed=3), _random(37, seed=4)
    x_before, y_before = x.clone(), y.clone()
    out = exercise.vector_add(x, y)
    assert out.data_ptr() not in (x.data_ptr(), y.data_ptr())
    assert torch.equal(x, x_before) and torch.equal(y, y_before)
    empty = exercise.vector_add(_random(0), _random(0))
    assert empty.shape == (0,)
    with pytest.raises(ValueError):
        exercise.vector_add(_random(5), _random(6))


@pytest.mark.points(3)
def test_rms_norm_kernel_launched_directly(exercise):
    """rms_norm_kernel: one program per row; load the row with mask = cols < n_cols and other=0.0 (so the
    padding adds nothing to the sum of squares), divide the sum by n_cols, not by BLOCK, and mask the store."""
    x, weight, out = _checked_rms_norm(exercise)
    _assert_close(out, _rms_norm_reference(x, weight, 1e-6))


@pytest.mark.points(1)
@pytest.mark.parametrize(("rows", "n_cols"), [(1, 16), (3, 40), (7, 100), (4, 257)])
def test_rms_norm_ragged_shapes(exercise, rows, n_cols):
    """rms_norm flattens x to [rows, n_cols], launches one program per row with BLOCK =
    triton.next_power_of_2(n_cols), and gives the same numbers as torch in float32."""
    _checked_rms_norm(exercise)  # a kernel without its masks would write past the last row
    x, weight = _random(rows, n_cols, seed=rows), _random(n_cols, seed=n_cols)
    _assert_close(exercise.rms_norm(x, weight, 1e-5), _rms_norm_reference(x, weight, 1e-5))


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_rms_norm_16bit(exercise, dtype):
    """16-bit inputs: load, then .to(tl.float32) before squaring and summing (a 16-bit sum of squares loses
    precision), and store in the output's dtype; the result has x's dtype."""
    _checked_rms_norm(exercise)  # a kernel without its masks would write past the last row
    x, weight = _random(6, 96, dtype=dtype, seed=7), _random(96, dtype=dtype, seed=8)
    _assert_close(exercise.rms_norm(x, weight, 1e-6), _rms_norm_reference(x, weight, 1e-6))


@pytest.mark.points(1)
def test_rms_norm_shapes_and_edge_cases(exercise):
    """rms_norm keeps any leading shape ([2, 3, n] in, [2, 3, n] out), returns an empty tensor for zero rows,
    gives 0 (not NaN) for a row of zeros thanks to eps, and raises ValueError for a weight of the wrong size."""
    _checked_rms_norm(exercise)  # a kernel without its masks would write past the last row
    x, weight = _random(2, 3, 24, seed=9), _random(24, seed=10)
    out = exercise.rms_norm(x, weight, 1e-6)
    _assert_close(out, _rms_norm_reference(x, weight, 1e-6))
    assert exercise.rms_norm(_random(0, 24), weight).shape == (0, 24)
    zeros = exercise.rms_norm(torch.zeros(2, 24, device=DEVICE), weight, 1e-6)
    assert torch.equal(zeros, torch.zeros_like(zeros))
    with pytest.raises(ValueError):
        exercise.rms_norm(x, _random(23))

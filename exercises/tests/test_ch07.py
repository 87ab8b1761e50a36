"""Graded tests for chapter 07 (``minserve grade ch07``). Each test's docstring is the hint a learner sees.

The format is checked on hand-worked groups first (the scale, round to nearest, the zero point, a constant
group), then by hypothesis on random weights: rows of random spreads and offsets, cut into groups of 4 to
64, with a zero row, a constant row and an outlier thrown in. Rounding to nearest promises every element
back within half a step (``scale / 2``); float32 arithmetic on the way adds a few units in the last place of
the largest weight, the slack allowed. The learner's numbers are cross-checked against the engine's own int4
(:mod:`minserve.quant.formats`, which the learner's file may not import), and the last tests show why the
format is asymmetric and grouped: a shifted group comes back far better than a symmetric grid manages, and an
outlier spoils only its own group.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.quant import formats

PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ARITHMETIC = 1e-6  # float32 slack, relative to the largest |weight| (a few ulps)


@st.composite
def weights(draw):
    """A ``[out, in]`` float32 weight and a group size that divides ``in``: rows of a random spread around a
    random offset (groups rarely centred on zero), sometimes a zero row, a constant row or one outlier."""
    group_size = draw(st.sampled_from([4, 8, 16, 32, 64]))
    out, groups = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    spread, offset = draw(st.floats(1e-3, 1e3)), draw(st.floats(-10.0, 10.0))
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, group_size * groups, generator=generator) + offset) * spread
    if draw(st.booleans()):
        w[0] = 0.0  # a zero row: its scales must be 1, not 0
    if out > 1 and draw(st.booleans()):
        w[1] = spread * offset  # a constant row: every group's max equals its min
    if draw(st.booleans()):
        w[-1, draw(st.integers(0, w.shape[1] - 1))] *= 20.0  # an outlier
    return w, group_size


def _per_element(group_values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[out, groups]`` numbers spread over their groups' elements: ``[out, groups * group_size]``."""
    return group_values.repeat_interleave(group_size, dim=1)


def _slack(w: torch.Tensor) -> torch.Tensor:
    return ARITHMETIC * w.abs().amax().clamp(min=1e-30)


def _round_trip(exercise, w, group_size):
    codes, scales, zeros = exercise.quantize_int4(w, group_size)
    return codes, scales, zeros, exercise.dequantize_int4(codes, scales, zeros, group_size)


def _symmetric_int4_round_trip(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The symmetric alternative: per group, scale = max|w| / 7 and codes −8 … 7 with no zero point."""
    out, inp = w.shape
    groups = w.view(out, inp // group_size, group_size)
    scales = groups.abs().amax(dim=2, keepdim=True) / 7
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (torch.round(groups / scales).clamp(-8, 7) * scales).view(out, inp)


# --- hand-worked groups ------------------------------------------------------------------------------------

HAND = torch.tensor(
    [
        [0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0],  # range 3 → scale 0.2; then a constant group
        [-3.0, 0.0, 1.5, -1.5, 0.0, 0.0, 0.0, 0.0],  # range 4.5 → scale 0.3; then a zero group
        [0.0, 0.29, 0.64, 1.5, -7.5, 0.2, 7.5, -3.2],  # 2.9 → 3 and 6.4 → 6: nearest, not floor or ceiling
    ]
)


@pytest.mark.points(2)
def test_scales_codes_and_zeros_by_hand(exercise):
    """Per group: scale = (max − min) / 15, code = round((w − min) / scale), zero = min + 8 · scale. The group
    [0, 1, 2, 3] has scale 0.2, codes [0, 5, 10, 15] and zero 1.6; [0, 0.29, 0.64, 1.5] rounds to [0, 3, 6, 15]."""
    codes, scales, zeros = exercise.quantize_int4(HAND, 4)
    assert codes.tolist() == [[0, 5, 10, 15, 0, 0, 0, 0], [0, 10, 15, 5, 0, 0, 0, 0], [0, 3, 6, 15, 0, 8, 15, 4]]
    torch.testing.assert_close(scales, torch.tensor([[0.2, 1.0], [0.3, 1.0], [0.1, 1.0]]))
    torch.testing.assert_close(zeros, torch.tensor([[1.6, 13.0], [-0.6, 8.0], [0.8, 0.5]]))


@pytest.mark.points(1)
def test_a_constant_group_gets_scale_one(exercise):
    """A group whose max equals its min (all zeros, or one value repeated) gets scale 1.0, never 0: no division
    by zero, no NaN, its codes are all 0 and it comes back as itself."""
    w = torch.tensor([[0.0] * 8, [-2.5] * 8, [7.0] * 4 + [1.0, 2.0, 3.0, 4.0]])
    codes, scales, _, back = _round_trip(exercise, w, 4)
    assert scales[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(codes[:, :4], torch.zeros(3, 4, dtype=torch.uint8))
    assert not torch.isnan(back).any()
    torch.testing.assert_close(back[:, :4], w[:, :4], rtol=0, atol=1e-5)
    assert back[0].tolist() == [0.0] * 8  # (0 − 8) · 1 + 8 is exactly 0


@pytest.mark.points(1)
def test_dequantize_by_hand(exercise):
    """(code − 8) · scale + zero, each element with its own group's scale and zero. Widen the codes to float
    before subtracting 8: in uint8, 3 − 8 wraps around to 251."""
    codes = torch.tensor([[0, 8, 15, 3, 8, 8, 0, 15]], dtype=torch.uint8)
    scales, zeros = torch.tensor([[0.5, 2.0]]), torch.tensor([[1.0, -1.0]])
    back = exercise.dequantize_int4(codes, scales, zeros, 4)
    assert back.dtype == torch.float32 and back.shape == (1, 8)
    assert back.tolist() == [[-3.0, 1.0, 4.5, -1.5, -1.0, -1.0, -17.0, 13.0]]


@pytest.mark.points(1)
def test_shapes_and_dtypes(exercise):
    """codes are uint8 [out, in]; scales and zeros float32 [out, in // group_size], whatever the weight's dtype
    (a bfloat16 weight too); dequantize_int4 gives float32 [out, in]."""
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    for weight in (w, w.to(torch.bfloat16)):
        codes, scales, zeros, back = _round_trip(exercise, weight, 32)
        assert codes.dtype == torch.uint8 and codes.shape == (6, 96)
        assert scales.dtype == zeros.dtype == torch.float32 and scales.shape == zeros.shape == (6, 3)
        assert back.dtype == torch.float32 and back.shape == (6, 96)


@pytest.mark.points(1)
def test_a_group_size_that_does_not_divide_the_row_is_an_error(exercise):
    """Groups must tile a row exactly: a group size of 64 on 96 inputs (or 0) raises ValueError, and the message
    names both numbers."""
    w = torch.randn(2, 96)
    with pytest.raises(ValueError) as raised:
        exercise.quantize_int4(w, 64)
    assert "64" in str(raised.value) and "96" in str(raised.value), f"message: {raised.value}"
    with pytest.raises(ValueError):
        exercise.quantize_int4(w, 0)


# --- properties on random weights --------------------------------------------------------------------------


@pytest.mark.points(2)
@PROPERTY
@given(case=weights())
def test_codes_are_uint8_between_0_and_15(exercise, case):
    """Codes are uint8 and clamped to 0 … 15; each group uses code 0 for its minimum and 15 for its maximum
    (unless it is constant)."""
    w, group_size = case
    codes, scales, _ = exercise.quantize_int4(w, group_size)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    out, inp = w.shape
    grouped = codes.view(out, inp // group_size, group_size)
    spans = w.view(out, inp // group_size, group_size)
    varied = spans.amax(dim=2) > spans.amin(dim=2)
    assert torch.all(grouped.amin(dim=2)[varied] == 0) and torch.all(grouped.amax(dim=2)[varied] == 15)
    assert torch.all(scales > 0), "a scale of 0 (a constant group?) must be 1.0"


@pytest.mark.points(3)
@PROPERTY
@given(case=weights())
def test_every_weight_comes_back_within_half_a_step(exercise, case):
    """Round to nearest: every element comes back within scale / 2 of its group (plus float32 rounding), for
    rows of any spread and offset, a zero row and a constant row included. Truncating (floor) would miss by up
    to a whole step."""
    w, group_size = case
    _, scales, _, back = _round_trip(exercise, w, group_size)
    assert back.shape == w.shape and not torch.isnan(back).any()
    error = (back - w).abs()
    bound = _per_element(scales, group_size) / 2 + _slack(w)
    worst = int(torch.argmax(error - bound))
    assert torch.all(error <= bound), f"element {divmod(worst, w.shape[1])}: off by {float(error.flatten()[worst]):.4g}"


@pytest.mark.points(1)
@PROPERTY
@given(case=weights())
def test_the_middle_code_is_the_zero_point(exercise, case):
    """zeros holds the value of code 8 (torch's int4 kernels' convention): dequantizing a code of 8 gives
    zero, and code 0 gives the group's minimum (zero − 8 · scale)."""
    w, group_size = case
    _, scales, zeros = exercise.quantize_int4(w, group_size)
    eights = torch.full(w.shape, 8, dtype=torch.uint8)
    back = exercise.dequantize_int4(eights, scales, zeros, group_size)
    torch.testing.assert_close(back, _per_element(zeros, group_size), rtol=0, atol=0)
    out, inp = w.shape
    low = w.float().view(out, inp // group_size, group_size).amin(dim=2)
    from_zero = exercise.dequantize_int4(torch.zeros_like(eights), scales, zeros, group_size)
    # zero − 8 · scale rounds at the size of zero (a constant group's zero is its value + 8)
    slack = ARITHMETIC * (_per_element(zeros.abs(), group_size) + 8 * _per_element(scales, group_size)) + _slack(w)
    assert torch.all((from_zero - _per_element(low, group_size)).abs() <= slack), "code 0 must be the group's minimum"


def _same_grid_point(mine, engine, w, scales, group_size):
    """Equal up to float32 rounding; or one step apart where the weight lies on a tie between two codes
    (any correct arithmetic may round a tie either way)."""
    step = _per_element(scales, group_size)
    diff = (mine - engine).abs()
    close = diff <= _slack(w) * 16
    tie = (diff <= step * (1 + 1e-4)) & (((w - engine).abs() - step / 2).abs() <= step * 1e-4 + _slack(w))
    return close | tie


@pytest.mark.points(2)
@PROPERTY
@given(case=weights())
def test_agrees_with_the_engines_int4(exercise, case):
    """The same numbers as minserve's own int4 (minserve.quant.formats): its scales, its zeros (the value of
    code 8), and the same dequantized weight."""
    w, group_size = case
    _, scales, zeros, back = _round_trip(exercise, w, group_size)
    engine = formats.quantize(w, "int4", group_size)
    torch.testing.assert_close(scales, engine.scales, rtol=1e-5, atol=0)
    torch.testing.assert_close(zeros, engine.zeros, rtol=0, atol=float(_slack(w)) * 16)
    agree = _same_grid_point(back, engine.dequantize(), w, engine.scales, group_size)
    assert torch.all(agree), f"{int((~agree).sum())} elements differ from the engine's int4"


# --- the linear layer --------------------------------------------------------------------------------------


@pytest.mark.points(1)
@pytest.mark.parametrize("leading", [(), (5,), (2, 3)], ids=["vector", "tokens", "batch-tokens"])
def test_int4_linear_is_x_times_the_dequantized_weight(exercise, leading):
    """int4_linear(x, …) is x @ dequantize_int4(…).T (+ bias when one is given), float32 [..., out], for x of
    any leading shape ([in], [tokens, in], [batch, tokens, in]) as nn.Linear takes it."""
    generator = torch.Generator().manual_seed(1)
    w, x = torch.randn(24, 64, generator=generator), torch.randn(*leading, 64, generator=generator)
    bias = torch.randn(24, generator=generator)
    codes, scales, zeros = exercise.quantize_int4(w, 16)
    expected = x @ exercise.dequantize_int4(codes, scales, zeros, 16).T
    for b, want in ((None, expected), (bias, expected + bias)):
        y = exercise.int4_linear(x, codes, scales, zeros, 16, b)
        assert y.dtype == torch.float32 and y.shape == (*leading, 24)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.points(2)
@PROPERTY
@given(case=weights(), tokens=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_int4_linear_is_close_to_the_float_layer(exercise, case, tokens, seed):
    """Each output of the int4 layer is within the error the weights allow: |y_int4 − y| ≤ Σ |x_i| · scale / 2
    over the row's inputs (each weight off by at most half its group's step)."""
    w, group_size = case
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(seed))
    codes, scales, zeros = exercise.quantize_int4(w, group_size)
    y = exercise.int4_linear(x, codes, scales, zeros, group_size)
    bound = x.abs() @ (_per_element(scales, group_size) / 2 + _slack(w)).T
    slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-30
    assert y.shape == (tokens, w.shape[0])
    assert torch.all((y - x @ w.T).abs() <= bound + slack)


# --- what it costs and why it is built so ------------------------------------------------------------------


@pytest.mark.points(1)
def test_bits_per_weight(exercise):
    """4 bits of code plus a scale and a zero per group: 4 + 2 · scale_bits / group_size. Groups of 64 with
    16-bit scales cost 4 + 32 / 64 = 4.5 bits a weight; groups of 32, 5 bits."""
    for group_size, bits in ((32, 5.0), (64, 4.5), (128, 4.25), (256, 4.125)):
        assert exercise.bits_per_weight(group_size) == pytest.approx(bits), f"group size {group_size}"
    assert exercise.bits_per_weight(64, scale_bits=32) == pytest.approx(5.0)  # float32 scales and zeros
    assert exercise.bits_per_weight(32, scale_bits=8) == pytest.approx(4.5)


@pytest.mark.points(1)
def test_bits_per_weight_matches_the_engines_storage(exercise):
    """With the default 16-bit scales and zeros, bits_per_weight is what minserve's int4 weights take in
    memory: their nbytes × 8 / the number of weights."""
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    for group_size in formats.GROUP_SIZES:
        stored = formats.quantize(w, "int4", group_size).nbytes * 8 / w.numel()
        assert exercise.bits_per_weight(group_size) == pytest.approx(stored)


@pytest.mark.points(2)
def test_asymmetric_beats_symmetric_on_a_shifted_group(exercise):
    """Weights all in [1, 2]: a symmetric grid (−max|w| … max|w|) spends half its codes on negatives the
    group never has, while the zero point puts all 16 codes on [1, 2]. The mean round-trip error must be well
    under half the symmetric one's (it is about a quarter)."""
    w = 1 + torch.rand(8, 128, generator=torch.Generator().manual_seed(3))
    *_, back = _round_trip(exercise, w, 64)
    asymmetric = float((back - w).abs().mean())
    symmetric = float((_symmetric_int4_round_trip(w, 64) - w).abs().mean())
    assert asymmetric < symmetric / 2, f"mean error {asymmetric:.4f}, symmetric int4 {symmetric:.4f}"


@pytest.mark.points(2)
def test_an_outlier_spoils_only_its_own_group(exercise):
    """One weight 100 times the others widens its own group's step, and no other group's: the other groups'
    scales and round-trip errors are what they were without it."""
    generator = torch.Generator().manual_seed(4)
    w = 0.01 * torch.randn(4, 256, generator=generator)
    spiked = w.clone()
    spiked[2, 10] = 1.0  # in group 0 of row 2
    _, plain_scales, _, plain_back = _round_trip(exercise, w, 64)
    _, scales, _, back = _round_trip(exercise, spiked, 64)
    assert float(scales[2, 0]) > 10 * float(plain_scales[2, 0]), "the outlier's group must widen its step"
    untouched = torch.ones(4, 4, dtype=torch.bool)
    untouched[2, 0] = False
    assert torch.equal(scales[untouched], plain_scales[untouched])
    assert torch.equal(back[:, 64:], plain_back[:, 64:]) and torch.equal(back[:2], plain_back[:2])

"""Graded tests for chapter 07 (``minserve grade ch07``). Each test's docstring is the hint a learner sees.

The learner designs a weight quantizer for a budget of bits per weight. The tests measure what it does, not
how: the storage it takes (counted here, from the tensors it keeps), the error of the round trip on
synthetic weights (Gaussian rows, rows off centre, a few large outliers), its linear layer, and what it does
to a real model: every projection of the embedded model (``minserve-tiny``) quantized at the budget, then
its next-token distributions against the float model's on held-out text (chapter 07's KL and top-1
agreement, :mod:`minserve.quality.agreement`). The error bounds are the reference design's errors with a
margin of about a quarter, so a sound design other than the reference's passes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from minserve import LLM
from minserve import exercise_harness as harness

BUDGETS = (3.25, 4.5, 8.5)  # bits per weight, metadata included


def _gaussian(out: int, inp: int, seed: int) -> torch.Tensor:
    """Rows of different spreads, like a trained layer's."""
    generator = torch.Generator().manual_seed(seed)
    spreads = torch.exp(0.5 * torch.randn(out, 1, generator=generator))
    return torch.randn(out, inp, generator=generator) * spreads * 0.02


def _with_outliers(weight: torch.Tensor, seed: int, share: float = 0.005, factor: float = 30.0):
    """``weight`` with ``share`` of its entries ``factor`` times larger; and the mask of the others."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(weight.numel(), generator=generator)[: max(1, int(share * weight.numel()))]
    w = weight.clone()
    w.view(-1)[chosen] *= factor
    inliers = torch.ones_like(w, dtype=torch.bool)
    inliers.view(-1)[chosen] = False
    return w, inliers


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor held by ``value``: itself, inside lists, tuples and dicts, or in an object's attributes."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return [t for v in vars(value).values() for t in _tensors(v)] if hasattr(value, "__dict__") else []


def storage_bits(q: object, weight: torch.Tensor) -> float:
    """Bits per weight ``q`` stores: its codes packed at ``q.code_bits``, every other tensor it holds at its
    dtype's size. Checks that the codes are integers within ``0 … 2**code_bits − 1``, one per weight."""
    codes, bits = q.codes, q.code_bits
    assert isinstance(bits, int) and 1 <= bits <= 8, f"code_bits must be an integer from 1 to 8, got {bits!r}"
    assert not codes.is_floating_point() and codes.shape == weight.shape, (codes.dtype, tuple(codes.shape))
    assert int(codes.min()) >= 0 and int(codes.max()) < 2**bits, "a code is outside 0 … 2**code_bits − 1"
    others = [t for t in _tensors(q) if t is not codes]
    return bits + sum(8 * t.numel() * t.element_size() for t in others) / weight.numel()


def relative_error(exercise, weight: torch.Tensor, budget: float, mask: torch.Tensor | None = None) -> float:
    """‖W − dequantize(quantize(W))‖ / ‖W‖, over the entries in ``mask`` (all by default)."""
    q = exercise.quantize(weight, budget)
    assert storage_bits(q, weight) <= budget + 1e-9
    back = exercise.dequantize(q)
    assert back.dtype == torch.float32 and back.shape == weight.shape
    mask = torch.ones_like(weight, dtype=torch.bool) if mask is None else mask
    return ((back - weight)[mask].norm() / weight[mask].norm()).item()


@pytest.mark.points(3)
@pytest.mark.parametrize("shape", [(64, 512), (96, 688), (8, 96)])
def test_quantize_keeps_the_budget(exercise, shape):
    """Codes are integers in 0 … 2**code_bits − 1, one per weight; the codes packed at code_bits plus every
    other tensor the QuantizedWeight holds (at its dtype's size) must fit the budget, for row lengths that
    64 does not divide (688 = 16 × 43) too. dequantize returns float32 of the weight's shape."""
    weight = _gaussian(*shape, seed=1)
    for budget in BUDGETS:
        q = exercise.quantize(weight, budget)
        assert storage_bits(q, weight) <= budget + 1e-9, f"{storage_bits(q, weight):.3f} bits > {budget}"
        back = exercise.dequantize(q)
        assert back.dtype == torch.float32 and back.shape == weight.shape


@pytest.mark.points(3)
def test_error_on_gaussian_weights(exercise):
    """Relative round-trip error on Gaussian rows of different spreads: at most 0.25 at 3.25 bits, 0.11 at 4.5
    bits and 0.0065 at 8.5 bits. One scale for the whole matrix is far from enough."""
    weight = _gaussian(256, 512, seed=2)
    for budget, bound in zip(BUDGETS, (0.25, 0.11, 0.0065)):
        error = relative_error(exercise, weight, budget)
        assert error <= bound, f"relative error {error:.4f} at {budget} bits (at most {bound})"


@pytest.mark.points(4)
def test_error_with_outliers(exercise):
    """One weight in 200 thirty times larger: at 4.5 bits the relative error must stay at most 0.16, and on the
    ordinary weights at most 0.37 of their own size. An outlier may spoil the grid of its neighbours, not the
    whole row's or the matrix's."""
    weight, inliers = _with_outliers(_gaussian(256, 512, seed=3), seed=3)
    error = relative_error(exercise, weight, 4.5)
    assert error <= 0.16, f"relative error {error:.4f} (at most 0.16)"
    error = relative_error(exercise, weight, 4.5, inliers)
    assert error <= 0.37, f"relative error on the ordinary weights {error:.4f} (at most 0.37)"


@pytest.mark.points(2)
def test_weights_off_centre(exercise):
    """Rows whose weights all lie in [1, 2] (a layer with an offset): at 4.5 bits the mean absolute error must
    stay under 0.02, which a grid centred on zero cannot reach without spending its levels on [-2, 1)."""
    generator = torch.Generator().manual_seed(4)
    weight = 1 + torch.rand(64, 512, generator=generator)
    q = exercise.quantize(weight, 4.5)
    assert storage_bits(q, weight) <= 4.5 + 1e-9
    error = (exercise.dequantize(q) - weight).abs().mean().item()
    assert error < 0.02, f"mean absolute error {error:.4f}"


@pytest.mark.points(2)
def test_more_bits_never_hurt(exercise):
    """A larger budget gives a smaller error: 3.25 < 4.5 < 8.5 bits, on the same weight."""
    weight = _gaussian(128, 256, seed=5)
    errors = [relative_error(exercise, weight, budget) for budget in BUDGETS]
    assert errors[0] > errors[1] > errors[2], errors


@pytest.mark.points(2)
@pytest.mark.parametrize("leading", [(5,), (2, 3)])
def test_quantized_linear_is_the_dequantized_layer(exercise, leading):
    """quantized_linear(x, q, bias) is x @ dequantize(q).T (+ bias), float32, for x of any leading shape."""
    weight = _gaussian(48, 96, seed=6)
    q = exercise.quantize(weight, 4.5)
    generator = torch.Generator().manual_seed(7)
    x, bias = torch.randn(*leading, 96, generator=generator), torch.randn(48, generator=generator)
    expected = x @ exercise.dequantize(q).T
    torch.testing.assert_close(exercise.quantized_linear(x, q), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(exercise.quantized_linear(x, q, bias), expected + bias, rtol=1e-4, atol=1e-5)


@pytest.mark.points(1)
def test_the_codes_and_their_numbers_are_all_it_keeps(exercise):
    """dequantize reads only what the QuantizedWeight holds: a deep copy of it, with the original weight
    changed after quantizing, gives back the same weight."""
    weight = _gaussian(32, 128, seed=8)
    q = exercise.quantize(weight, 4.5)
    expected = exercise.dequantize(q).clone()
    copied = copy.deepcopy(q)
    weight.mul_(3.0)
    torch.testing.assert_close(exercise.dequantize(copied), expected, rtol=0, atol=0)


@pytest.mark.points(5)
def test_the_embedded_model_agrees_with_its_float_self(exercise):
    """Every projection of minserve-tiny quantized at 4.5 bits per weight: on 512 tokens of held-out text,
    the mean KL divergence from the float model's next-token distribution must stay under 0.01 nats and
    the top-1 agreement at least 0.9 (the reference design: about 0.004 and 0.94)."""
    _checked_round_trip(exercise, _gaussian(8, 64, seed=9), 4.5)  # fails fast, before loading any model
    candidate = LLM()
    harness.replace_linear_weights(candidate, lambda w: _checked_round_trip(exercise, w, 4.5))
    reference = LLM()
    agreement = harness.agreement_with_float(reference, candidate, num_tokens=512)
    assert agreement.kl_per_token < 0.01, f"KL {agreement.kl_per_token:.4f} nats per token"
    assert agreement.top1_agreement >= 0.9, f"top-1 agreement {agreement.top1_agreement:.3f}"


def _checked_round_trip(exercise, weight: torch.Tensor, budget: float) -> torch.Tensor:
    q = exercise.quantize(weight, budget)
    assert storage_bits(q, weight) <= budget + 1e-9, f"{storage_bits(q, weight):.3f} bits > {budget}"
    return exercise.dequantize(q)

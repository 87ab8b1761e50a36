"""Chapter 07 exercise, reference solution (instructors: ``minserve grade ch07 --solutions``).

The design: an affine grid per group of consecutive inputs of a row, chosen per matrix. For every code
width from 8 bits down to 2, the smallest group (a divisor of the row length) whose float16 metadata still
fits the budget, with a zero point or without; each candidate is tried on the matrix itself, and the one
with the least squared error wins. Codes round to nearest.
"""

from __future__ import annotations

import torch

META_BITS = 16  # scales and zero points are stored in float16


class QuantizedWeight:
    """A weight ``[out, in]`` as integer codes and the per-group numbers that map them back to floats."""

    def __init__(
        self, codes: torch.Tensor, code_bits: int, meta: dict[str, torch.Tensor], layout: dict[str, int | bool]
    ) -> None:
        self.codes, self.code_bits, self.meta, self.layout = codes, code_bits, meta, layout


def storage_bits_per_weight(q: QuantizedWeight) -> float:
    """Bits per weight the format stores: the codes packed at ``code_bits``, plus every metadata tensor."""
    meta_bits = sum(8 * t.numel() * t.element_size() for t in q.meta.values())
    return q.code_bits + meta_bits / q.codes.numel()


def _group_sizes(in_features: int) -> list[int]:
    return [g for g in range(1, in_features + 1) if in_features % g == 0]


def _candidates(in_features: int, budget_bits: float) -> list[tuple[int, int, bool]]:
    """(code bits, group size, symmetric): for the two widest codes that fit, each grid with the smallest group
    the budget leaves room for (a narrower code with smaller groups never won on the weights tried)."""
    found = []
    for bits in range(8, 1, -1):
        for symmetric in (False, True):
            meta = META_BITS * (1 if symmetric else 2)
            fitting = [g for g in _group_sizes(in_features) if bits + meta / g <= budget_bits]
            if fitting:
                found.append((bits, fitting[0], symmetric))
    widths = sorted({bits for bits, _, _ in found}, reverse=True)[:2]
    return [candidate for candidate in found if candidate[0] in widths]


def _quantize_with(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> QuantizedWeight:
    out, inp = weight.shape
    groups = weight.float().reshape(out, inp // group_size, group_size)
    top = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1) - 1  # codes 1 … 2·half around the middle code half (code 0 unused)
        scale = (groups.abs().amax(dim=2) / half).clamp(min=1e-8).half()
        low = (-half * scale.float()).half()
    else:
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        scale = ((hi - lo) / top).clamp(min=1e-8).half()
        low = lo.half()
    codes = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp(0, top)
    meta = {"scale": scale} if symmetric else {"scale": scale, "low": low}
    layout = {"group_size": group_size, "symmetric": symmetric}
    return QuantizedWeight(codes.to(torch.uint8).reshape(out, inp), bits, meta, layout)


def quantize(weight: torch.Tensor, budget_bits: float) -> QuantizedWeight:
    """The grid with the least squared error on ``weight`` among those that fit ``budget_bits`` per weight."""
    candidates = _candidates(weight.shape[1], budget_bits)
    if not candidates:
        raise ValueError(f"no grid fits {budget_bits} bits per weight")
    best, best_error = None, float("inf")
    for bits, group_size, symmetric in candidates:
        q = _quantize_with(weight, bits, group_size, symmetric)
        error = (dequantize(q) - weight.float()).square().sum().item()
        if error < best_error:
            best, best_error = q, error
    return best


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight the codes stand for."""
    out, inp = q.codes.shape
    group_size = q.layout["group_size"]
    codes = q.codes.reshape(out, inp // group_size, group_size).float()  # widened: no uint8 wrap
    scale = q.meta["scale"]
    low = q.meta["low"] if not q.layout["symmetric"] else (-(2 ** (q.code_bits - 1) - 1) * scale.float()).half()
    return (low.float()[..., None] + codes * scale.float()[..., None]).reshape(out, inp)


def quantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with ``W`` the dequantized weight, for ``x`` of any leading shape."""
    y = x.float() @ dequantize(q).T
    return y if bias is None else y + bias.float()

"""Chapter 07 exercise, reference solutions (instructors: ``minserve grade ch07 --solutions``)."""

from __future__ import annotations

import torch

LEVELS = 16  # a 4-bit code is 0 … 15
MIDDLE = 8  # the code whose value is the zero point


def _check_group_size(in_features: int, group_size: int) -> None:
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input features of a row")


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group_size`` inputs: codes (uint8, 0 … 15), scales and zeros (float32)."""
    out, inp = weight.shape
    _check_group_size(inp, group_size)
    groups = weight.float().view(out, inp // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = (high - low) / (LEVELS - 1)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: 1, never 0
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, LEVELS - 1)
    zeros = low + MIDDLE * scales  # the value of the middle code
    return codes.to(torch.uint8).view(out, inp), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(code − 8) · scale + zero`` for every element, float32 ``[out, in]``."""
    out, inp = codes.shape
    _check_group_size(inp, group_size)
    grouped = codes.view(out, inp // group_size, group_size).float() - MIDDLE  # widened first: no uint8 wrap
    return (grouped * scales.float()[..., None] + zeros.float()[..., None]).view(out, inp)


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` the dequantized weight, for ``x`` of any leading shape."""
    y = x.float() @ dequantize_int4(codes, scales, zeros, group_size).T
    return y if bias is None else y + bias.float()


def bits_per_weight(group_size: int, scale_bits: int = 16) -> float:
    """Storage per weight: 4 bits of code plus a scale and a zero shared by ``group_size`` weights."""
    return 4 + 2 * scale_bits / group_size

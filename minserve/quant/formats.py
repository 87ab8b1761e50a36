"""Narrow number formats for weights: what is stored, and how to get a weight back from it.

A weight matrix ``w`` is ``[out_features, in_features]`` (the layout of ``nn.Linear``). Each format keeps small
integer (or 8-bit float) *codes* and the few full-precision numbers that map codes back to values:

==========  =====================================  =====================================================
format      per                                    value of a code ``q``
==========  =====================================  =====================================================
``int8``    output channel (one scale a row)       ``q * scale``, ``q`` in [-127, 127] (symmetric)
``int4``    group of ``group_size`` inputs a row   ``(q - 8) * scale + zero``, ``q`` in [0, 15] (asymmetric)
``fp8``     output channel                         ``float(q) * scale``, ``q`` an e4m3 float (max 448)
==========  =====================================  =====================================================

Rounding is to nearest, so every element comes back within half a step: ``scale / 2`` for the integer
formats, and for fp8 half a unit in the last place (a relative 2⁻⁴) plus the subnormals' floor. Those are
the bounds the property tests check, and :func:`max_round_trip_error` states them per element.

int4 is asymmetric because a group's weights are rarely centred on zero: the zero point lets all sixteen
codes cover ``[min, max]`` of the group. Its ``zero`` is the value of the middle code 8, the convention of
torch's packed int4 matmuls (and gpt-fast's), so the same scales feed them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_LEVELS = 16
INT4_MIDDLE = 8
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)  # None on a torch without float8
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_MANTISSA_BITS = 3
FP8_SMALLEST_SUBNORMAL = 2.0**-9

WEIGHT_FORMATS = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128, 256)  # what torch's packed int4 CPU kernel takes


class QuantizationError(ValueError):
    """A format, group size or shape that cannot be quantized; the message says what to change."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out, in]`` weight as codes plus scales (and zero points for int4).

    ``codes`` has the weight's shape: int8 for ``int8``, uint8 holding 0…15 for ``int4`` (two fit a byte
    when stored; :attr:`nbytes` counts them so), float8_e4m3fn for ``fp8``. ``scales`` (and ``zeros``) are
    ``[out]`` per channel or ``[out, in // group_size]`` per group, in float32.
    """

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes a compact store needs: codes at their bit width, scales and zeros at 2 bytes (bf16)."""
        code_bits = 4 if self.format == "int4" else 8
        extra = self.scales.numel() + (0 if self.zeros is None else self.zeros.numel())
        return self.codes.numel() * code_bits // 8 + 2 * extra

    def with_scales_in(self, dtype: torch.dtype) -> QuantizedWeight:
        """The same codes with the scales (and zeros) rounded to ``dtype``, as a kernel that takes them so
        applies them: what its output must match."""
        zeros = None if self.zeros is None else self.zeros.to(dtype).float()
        return QuantizedWeight(self.format, self.codes, self.scales.to(dtype).float(), zeros, self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for, ``[out, in]`` in ``dtype``."""
        if self.format == "int4":
            assert self.zeros is not None and self.group_size is not None
            out, inp = self.shape
            grouped = (
                self.codes.view(out, inp // self.group_size, self.group_size).float() - INT4_MIDDLE
            ) * self.scales[..., None] + self.zeros[..., None]
            return grouped.view(out, inp).to(dtype)
        return (self.codes.float() * self.scales[:, None]).to(dtype)


def quantize(weight: torch.Tensor, format: str, group_size: int = 64) -> QuantizedWeight:
    """``weight`` in ``format`` (see the module's table); ``group_size`` is for int4 only."""
    if weight.dim() != 2:
        raise QuantizationError(f"only 2-D [out, in] weights quantize; got shape {tuple(weight.shape)}")
    if format == "int8":
        return quantize_int8(weight)
    if format == "int4":
        return quantize_int4(weight, group_size)
    if format == "fp8":
        return quantize_fp8(weight)
    raise QuantizationError(f"unknown weight format {format!r}; use one of {', '.join(WEIGHT_FORMATS)}")


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric, one scale per output channel: the row's largest magnitude maps to ±127."""
    w = weight.float()
    scales = _nonzero(w.abs().amax(dim=1) / INT8_MAX)
    codes = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight("int8", codes, scales)


def quantize_int4(weight: torch.Tensor, group_size: int = 64) -> QuantizedWeight:
    """Asymmetric per group of ``group_size`` consecutive inputs: a group's [min, max] spans codes 0…15."""
    out, inp = weight.shape
    check_group_size(inp, group_size)
    groups = weight.float().view(out, inp // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = _nonzero((high - low) / (INT4_LEVELS - 1))
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, INT4_LEVELS - 1)
    zeros = low + INT4_MIDDLE * scales  # the value of the middle code
    return QuantizedWeight("int4", codes.to(torch.uint8).view(out, inp), scales, zeros, group_size)


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """e4m3 codes, one scale per output channel: the row's largest magnitude maps to 448."""
    if FP8_DTYPE is None:
        raise QuantizationError(
            f"fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: upgrade torch (2.1 or later) "
            "or choose int8"
        )
    w = weight.float()
    scales = _nonzero(w.abs().amax(dim=1) / FP8_MAX)
    codes = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantizedWeight("fp8", codes, scales)


def check_group_size(in_features: int, group_size: int) -> None:
    """int4 groups must tile a row exactly; the message lists the group sizes that would."""
    if group_size <= 0 or in_features % group_size:
        fitting = [g for g in GROUP_SIZES if in_features % g == 0]
        raise QuantizationError(
            f"int4 group size {group_size} does not divide the layer's {in_features} input features; "
            + (f"choose {' or '.join(map(str, fitting))}" if fitting else f"none of {GROUP_SIZES} does")
        )


def max_round_trip_error(q: QuantizedWeight, weight: torch.Tensor) -> torch.Tensor:
    """The largest ``|dequantize(q) - weight|`` rounding to nearest allows, element by element."""
    if q.format == "int4":
        assert q.group_size is not None
        return (q.scales / 2).repeat_interleave(q.group_size, dim=1)
    if q.format == "int8":
        return (q.scales / 2)[:, None].expand(q.shape)
    # fp8: half an ulp of the scaled value (relative 2^-(mantissa + 1)), never below half the smallest step
    half_ulp = weight.float().abs() * 2.0 ** -(FP8_MANTISSA_BITS + 1)
    return torch.maximum(half_ulp, (FP8_SMALLEST_SUBNORMAL / 2) * q.scales[:, None])


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """A row (or group) of zeros gets scale 1, not 0: its codes are 0 either way, and nothing divides by 0."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))

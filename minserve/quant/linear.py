"""Linear layers that keep their weight in a narrow format and multiply without widening it in memory.

Each module stands in for an ``nn.Linear`` (same ``in_features``, ``out_features``, ``bias``, same call) and
differs only in what it stores and which kernel reads it. The model file never learns of them: a
quantized model is the same model with these modules swapped in (:mod:`minserve.quant.swap`).

The kernel is chosen by the weight's device:

* **CPU**: torch's own packed weight-only matmuls, ``aten._weight_int8pack_mm`` (int8 codes, a scale per
  channel) and ``aten._weight_int4pack_mm_for_cpu`` (int4 codes packed two a byte, a scale and zero point
  per group). They take 16-bit activations, so the input is rounded to bfloat16 on the way in: W8A16 and
  W4A16, as their names say. (Fed float32 activations, the int8 kernel takes a slow path, about 10 to 40
  times slower than with bfloat16 on this course's CPU: ``benchmarks/quantization.py --kernels``.)
* **CUDA, with triton installed**: the Triton kernels of :mod:`minserve.kernels.quant_matmul`,
  ``w8a16_matmul`` and ``w4a16_matmul``, which read the narrow codes and widen them inside the matmul's
  tiles, so a decode step reads 1 or ½ byte per weight instead of 2. They take the activations as they
  come (float16, bfloat16 or float32).
* **elsewhere** (MPS, CUDA without triton), and for fp8 everywhere for now (:class:`Fp8Linear` says how):
  the weight is widened to the activation dtype inside the forward and multiplied by ``F.linear``.
  Correct, as small in memory, but it moves more bytes per step than the full-precision layer.

What every kernel must equal is the weight widened from its codes with the scales as the kernel holds
them (:meth:`QuantizedWeight.with_scales_in`), times the input rounded as the kernel rounds it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from minserve.quant.formats import QuantizedWeight, quantize

ACTIVATION_DTYPE = torch.bfloat16  # what the CPU packed kernels take
INT8_INPUT_TILE = 16  # the CPU int8 kernel's stride through a row of inputs
INT4_INNER_K_TILES = 1  # the CPU int4 packing's tile count (any of 1, 2, 4 works on these shapes)


class QuantizedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held as :class:`~minserve.quant.formats.QuantizedWeight`'s codes."""

    format: str

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_nbytes = weight.nbytes
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64) -> QuantizedLinear:
        """Quantize ``linear``'s weight (it is not kept) into this module's format."""
        weight = quantize(linear.weight.detach(), cls.format, group_size)
        return cls(weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.matmul(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, in] → [n, out]`` in ``x``'s dtype, no bias."""
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out, in]``: the weight the codes stand for, with the scales the kernel applies."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Int8Linear(QuantizedLinear):
    """Symmetric int8 per output channel (W8A16)."""

    format = "int8"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        codes = weight.codes.contiguous()
        # The CPU kernel reads the inputs 16 at a time and runs past the end of a row that is not a multiple
        # of 16 (a segfault, in torch 2.13): such a weight gets zero columns, and the input zeros to match.
        self.input_padding = -self.in_features % INT8_INPUT_TILE if codes.device.type == "cpu" else 0
        self.register_buffer("codes", F.pad(codes, (0, self.input_padding)) if self.input_padding else codes)
        self.register_buffer("scales", weight.scales.to(ACTIVATION_DTYPE))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            x16 = (
                F.pad(x.to(ACTIVATION_DTYPE), (0, self.input_padding)) if self.input_padding else x.to(ACTIVATION_DTYPE)
            )
            return torch.ops.aten._weight_int8pack_mm(x16, self.codes, self.scales).to(x.dtype)
        kernels = _triton_kernels() if x.is_cuda else None
        if kernels is not None:
            return kernels.w8a16_matmul(x, self.codes[:, : self.in_features], self.scales)  # padded on a CPU
        return F.linear(x, self.dequantized_weight(x.dtype))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = self.codes[:, : self.in_features]
        return (codes.float() * self.scales.float()[:, None]).to(dtype)


class Int4Linear(QuantizedLinear):
    """Asymmetric int4 per group of inputs, with a zero point (W4A16)."""

    format = "int4"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        assert weight.zeros is not None and weight.group_size is not None
        self.group_size = weight.group_size
        # [in / group, out, 2]: per group and output, (scale, value of code 8): the packed kernel's layout.
        scales_and_zeros = torch.stack([weight.scales.t(), weight.zeros.t()], dim=-1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(ACTIVATION_DTYPE).contiguous())
        # The two packings have one shape, so a module moved across devices would read one as the other.
        self.packed_for = "cpu" if weight.codes.device.type == "cpu" else "nibbles"
        if weight.codes.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.codes.to(torch.int32), INT4_INNER_K_TILES
            )
            self.register_buffer("packed", packed)
        else:  # two codes a byte, low nibble first: the Triton kernel's layout, and the widening path's
            self.register_buffer("packed", pack_int4(weight.codes))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu") != (self.packed_for == "cpu"):
            raise RuntimeError(
                f"this Int4Linear was packed for {'the CPU' if self.packed_for == 'cpu' else 'a GPU'} and runs on "
                f"{x.device}: quantize on the device it runs on (LLM(device=...) quantizes after loading there)"
            )
        if x.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(ACTIVATION_DTYPE), self.packed, self.group_size, self.scales_and_zeros
            )
            return out.to(x.dtype)
        kernels = _triton_kernels() if x.is_cuda else None
        if kernels is not None:
            return kernels.w4a16_matmul(x, self.packed, self.scales_and_zeros, self.group_size)
        return F.linear(x, self.dequantized_weight(x.dtype))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.packed.device.type == "cpu":
            raise NotImplementedError("the CPU packing is the kernel's own; widen the QuantizedWeight instead")
        codes = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).flatten(1)  # [out, in], 0…15
        sz = self.scales_and_zeros.float()  # [groups, out, 2]
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()  # [out, groups]
        grouped = codes.float().view(self.out_features, -1, self.group_size) - 8
        return (grouped * scales[..., None] + zeros[..., None]).flatten(1).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` codes 0…15 → ``[out, in / 2]`` uint8, two a byte: the even input in the low nibble."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """:mod:`minserve.kernels.quant_matmul`, or None where triton is not installed (it is optional)."""
    try:
        from minserve.kernels import quant_matmul
    except ImportError:
        return None
    return quant_matmul


class Fp8Linear(QuantizedLinear):
    """e4m3 codes with a scale per output channel (W8A16 in an 8-bit float); widened in the forward.

    No CPU kernel multiplies e4m3 weights, and torch's own e4m3 → float conversion is a slow scalar loop
    here (3.3 ms for a 3072 × 576 weight). The codes widen instead by moving their bits into a float16's:
    sign to sign, the 4 exponent and 3 mantissa bits to the top of the float16's exponent and mantissa.
    That float16 is the e4m3 value divided by 2⁸ exactly, subnormals included (both formats' exponent
    biases differ by 8), so the 2⁸ joins the per-channel scale, applied to the output.
    """

    format = "fp8"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("output_scales", weight.scales.float() * 2.0**8)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, e4m3_as_float16(self.codes).to(x.dtype)) * self.output_scales.to(x.dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (e4m3_as_float16(self.codes).float() * self.output_scales[:, None]).to(dtype)


def e4m3_as_float16(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes as float16 values 2⁸ times smaller, exactly, by integer operations alone."""
    bits = codes.view(torch.uint8).to(torch.int16)
    return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16)


QUANTIZED_LINEARS: dict[str, type[QuantizedLinear]] = {cls.format: cls for cls in (Int8Linear, Int4Linear, Fp8Linear)}

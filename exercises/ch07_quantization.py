"""Chapter 07 exercise: group-wise asymmetric int4 weights, round to nearest.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch07

A weight matrix is ``[out, in]``, the layout of ``nn.Linear``: row ``j`` holds the weights output ``j``
multiplies the inputs by. int4 stores each weight as a 4-bit *code* (0 … 15, sixteen levels) and, for every
*group* of ``group_size`` consecutive inputs of a row, two float32 numbers that turn codes back into values:

    value of code q = (q − 8) · scale + zero

Three choices make this format, and each has a reason:

- **Groups.** One scale for a whole row would let a single outlier weight (ten times the others, as
  LLM weights have) stretch the row's grid, leaving the ordinary weights only a few levels. With a scale
  per group of, say, 64 inputs, an outlier spoils only its own group's resolution; the price is one scale
  and one zero per group, which is what :func:`bits_per_weight` counts.
- **Asymmetric.** A group's weights are rarely centred on zero, so a symmetric grid (−max|w| … +max|w|)
  wastes the levels on the side the group never reaches. Here the sixteen codes cover the group's own
  ``[min, max]``: code 0 is the group's minimum, code 15 its maximum, and the step between codes is
  ``scale = (max − min) / 15``. Rounding to the nearest code puts every weight back within ``scale / 2``.
- **The middle code.** ``zero`` is stored as the value of code 8, ``min + 8 · scale``, rather than the value
  of code 0. That is the convention of torch's packed int4 matmul kernels (and gpt-fast's), so the scales
  and zeros computed here could be handed to them unchanged. Written so, the formula above is a signed
  code ``q − 8`` (−8 … 7) times the scale, plus an offset.

Units: ``weight``, ``scales``, ``zeros`` and every returned value are in the weight's own units (whatever
the float weights were); ``codes`` are plain integers; ``group_size`` counts input features; bits are bits.
Work in float32 whatever the weight's dtype (``weight.float()``).

``Tensor.view(out, in // group_size, group_size)`` splits each row into its groups, ``amin``/``amax`` along
the last dimension give each group's range, and ``scales[..., None]`` broadcasts a group's number over its
``group_size`` weights. Use only torch and the standard library: the grader refuses a file that imports
minserve, whose own ``minserve.quant.formats`` is an answer.
"""

from __future__ import annotations

import torch

LEVELS = 16  # a 4-bit code is 0 … 15
MIDDLE = 8  # the code whose value is the zero point


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, zeros)`` for a float ``weight`` of shape ``[out, in]``, in groups of ``group_size``.

    Each row is cut into ``in // group_size`` groups of ``group_size`` consecutive inputs. Per group, with
    ``min`` and ``max`` its smallest and largest weight:

    - ``scale = (max − min) / 15``, the step between two codes; a group whose ``max == min`` (a constant or
      all-zero group) gets ``scale = 1.0``, never 0, so nothing divides by zero (its codes are all 0);
    - ``code = round((w − min) / scale)``, clamped to 0 … 15: rounding to nearest, so code 0 is ``min``
      and code 15 is ``max``;
    - ``zero = min + 8 · scale``, the value of the middle code 8.

    Returns ``codes`` as ``torch.uint8`` of shape ``[out, in]`` (one code an element; packing two to a byte is
    a storage detail left out here), and ``scales`` and ``zeros`` as float32 of shape
    ``[out, in // group_size]``. Raises ``ValueError``, naming both numbers, when ``group_size`` is not a
    positive divisor of ``in`` (a group size of 64 cannot tile a row of 96 inputs).
    """
    raise NotImplementedError


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight the codes stand for: ``(code − 8) · scale + zero`` per element, float32 ``[out, in]``.

    ``codes`` is ``[out, in]`` (uint8, 0 … 15), ``scales`` and ``zeros`` are ``[out, in // group_size]``, as
    :func:`quantize_int4` returns them; element ``[j, i]`` uses the numbers of group ``[j, i // group_size]``.
    Widen the codes to float before subtracting 8: in uint8, ``3 − 8`` wraps around to 251.
    """
    raise NotImplementedError


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A linear layer on int4 weights: ``x @ W.T`` (``+ bias``), with ``W`` the :func:`dequantize_int4` weight.

    ``x`` is ``[..., in]`` with any leading shape (``[in]``, ``[tokens, in]``, ``[batch, tokens, in]``), as
    ``nn.Linear`` takes it; the result is float32 ``[..., out]``. ``bias``, when given, is ``[out]``. (A real
    kernel never builds ``W``: it widens the codes tile by tile as it multiplies. The numbers are the same.)
    """
    raise NotImplementedError


def bits_per_weight(group_size: int, scale_bits: int = 16) -> float:
    """Bits of storage per weight: 4 for the code plus one scale and one zero shared by ``group_size`` weights.

    ``4 + 2 · scale_bits / group_size``: with 16-bit scales and zeros, groups of 64 cost 4 + 32 / 64 = 4.5
    bits a weight, groups of 32 cost 5. A float return value (bits, not bytes).
    """
    raise NotImplementedError

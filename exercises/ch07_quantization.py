"""Chapter 07 exercise: a weight quantizer of your own design, for a budget of bits per weight.

Fill in :func:`quantize`, :func:`dequantize` and :func:`quantized_linear` (replace ``raise
NotImplementedError``), then grade yourself:

    minserve grade ch07

You are handed a weight matrix ``[out, in]`` (a linear layer's, ``y = x @ W.T``) and a budget in bits per
weight, metadata included: 4.5 bits, say, for a format that must take at most 4.5 × out × in bits. You
choose the grid: how many bits a code takes, which weights share a grid (a whole row, or groups of
consecutive inputs, and how large), whether a grid is symmetric around zero or has a zero point of its own,
how the numbers it needs are stored, how a weight is rounded onto it. Different matrices may get different
choices. Whatever you choose must fit the budget, and is graded on what it does:

- **storage**: the grader counts it from your :class:`QuantizedWeight`: the codes at ``code_bits`` each
  (as if packed), plus every other tensor it holds at its dtype's size (a float16 number is 16 bits). Small
  Python numbers in ``layout`` (a group size, a flag) are free. It must fit every budget from 3.25 to 8.5
  bits, also for rows whose length 64 does not divide (688 = 16 × 43);
- **error** on synthetic weights: Gaussian rows of different spreads; rows that all lie far from zero; and
  rows where one weight in 200 is thirty times larger than the rest. Those outliers are what a trained
  model's weights have, and the grid must not let one of them spoil the precision of the others;
- **a real model**: every projection of the embedded model (``minserve-tiny``) goes through your round trip
  at 4.5 bits, and its next-token distributions on held-out text must stay close to the float model's:
  the mean KL divergence (nats per token) and the share of positions where both pick the same top token,
  chapter 07's own quality measures.

Import only the standard library and ``torch``: the grader refuses a file that imports minserve (whose
``quant`` package holds a working int4 format).
"""

from __future__ import annotations

import torch


class QuantizedWeight:
    """A weight matrix as your format stores it; what :func:`dequantize` reads, and all it may read.

    ``codes``: an integer tensor of the weight's shape, one code per weight, each in ``0 … 2**code_bits − 1``
    (a uint8 tensor is fine: the grader counts ``code_bits`` per code, as if packed). ``meta``: the tensors
    your grid needs to map codes back to floats (per-group or per-row numbers), counted at their dtype's
    size. ``layout``: a few Python numbers that describe the format (a group size, whether it is
    symmetric), not counted. Add attributes if your design needs them: every tensor the object holds is
    counted against the budget.
    """

    def __init__(
        self, codes: torch.Tensor, code_bits: int, meta: dict[str, torch.Tensor], layout: dict[str, int | bool]
    ) -> None:
        self.codes, self.code_bits, self.meta, self.layout = codes, code_bits, meta, layout


def storage_bits_per_weight(q: QuantizedWeight) -> float:
    """Bits per weight ``q`` takes: ``code_bits`` for each code plus the bits of every tensor in ``meta``,
    shared among all the weights. Given: the grader counts the same way (every tensor the object holds)."""
    meta_bits = sum(8 * t.numel() * t.element_size() for t in q.meta.values())
    return q.code_bits + meta_bits / q.codes.numel()


def quantize(weight: torch.Tensor, budget_bits: float) -> QuantizedWeight:
    """Quantize ``weight`` (float, ``[out, in]``) into a format that takes at most ``budget_bits`` bits per
    weight, metadata included, choosing the grid that serves this matrix best.

    The round trip should lose as little as it can: rows of different scales each keep their precision,
    weights that all sit far from zero are not rounded onto levels nobody uses, and a rare large weight
    costs precision only near it. A budget no grid fits (below 2 bits, say) is a ``ValueError``. The
    weight itself is not kept: only what the :class:`QuantizedWeight` holds survives.
    """
    raise NotImplementedError


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that ``q`` stands for, computed from what ``q`` holds and nothing
    else (a deep copy of ``q`` gives the same weight)."""
    raise NotImplementedError


def quantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The linear layer with the quantized weight: for ``x`` of shape ``[..., in]``, the float32 ``[..., out]``
    that the layer with the weight :func:`dequantize` gives returns (plus ``bias``, ``[out]``, when given)."""
    raise NotImplementedError

"""Weight-and-activation quantization (W8A8), simulated, and SmoothQuant's scale migration.

The weight-only formats of :mod:`.linear` keep the activations in 16 bits (W8A16, W4A16): the matmul
widens each weight code to bfloat16 and multiplies in floating point. W8A8 quantizes the input too, so the
multiply itself is int8 × int8 into an int32 accumulator, the operation int8 tensor cores (NVIDIA since
Turing), AMD's MI300 matrix cores and a CPU's VNNI / AMX instructions run at twice (or more) the rate of
16-bit floats. At small batch that buys nothing (decode is bound by reading the weights), but at large
batch, where the matmul turns compute-bound, it doubles the roof.

* **weights**: int8, one scale per output channel, set once (:func:`~.formats.quantize_int8`);
* **activations**: int8, one scale per *token* (row of ``x``), set on the fly from that row's largest
  magnitude: ``scale = max|x_row| / 127``. A "dynamic per-token" scale costs one reduction per row.

The trouble is the activations, not the weights. A few input channels of a trained transformer's layers run
far larger than the rest (Dettmers et al., 2022, "LLM.int8()"), and one scale per token is set by its largest
channel, so the other channels get only a few of the 255 levels. SmoothQuant (Xiao et al., 2023) migrates
the difficulty to the weights, which have no such outliers: for any positive ``s`` per input channel,
``x Wᵀ = (x / s)(W · s)ᵀ`` exactly, and with

    s_j = max|X_j|^α / max|W_j|^(1 − α)          (α ≈ 0.5)

the input's channel maxima and the weight's column maxima meet in the middle, so both quantize well.

**Simulated here.** No CPU kernel of torch multiplies int8 by int8 into int32 for a linear layer, so
:class:`W8A8Linear` rounds the input and the weight to their int8 grids and multiplies the rounded values in
float32 ("fake quantization"). The numbers equal the int8 kernel's up to float32's summation order (every
product of two codes is an integer below 2¹⁴, their sum of a few thousand below 2²⁴, so float32 holds it
exactly); the *speed* is not measured, and is slower than float32. And where a deployment folds ``1/s``
into the norm or layer that writes ``x`` (as :mod:`.awq` does), this module divides ``x`` at run time:
the same numbers, one more operation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minserve.quant.formats import QuantizedWeight, quantize_int8
from minserve.quant.linear import Int8Linear, QuantizedLinear

INT8_MAX = 127.0
SMOOTH_ALPHA = 0.5  # SmoothQuant's default; larger α moves more of the difficulty onto the weights
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # every decoder projection; the head stays


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[tokens, in]``) rounded to int8 with one symmetric scale per row, and read back as floats."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / INT8_MAX
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale


class W8A8Linear(QuantizedLinear):
    """``y = x Wᵀ + b`` with ``W`` in int8 per output channel and ``x`` in int8 per token, simulated.

    ``smooth`` (``[in]``, positive) is SmoothQuant's migration: ``weight`` holds the codes of ``W · s``, and
    the input is divided by ``s`` before it is rounded; ``None`` is plain W8A8."""

    format = "w8a8"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, smooth: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.register_buffer("codes", weight.codes)  # what a real kernel would store: 1 byte a weight
        self.register_buffer("scales", weight.scales.float())  # [out]
        self.register_buffer("smooth", None if smooth is None else smooth.float())

    @classmethod
    def from_linear(cls, linear: nn.Linear, smooth: torch.Tensor | None = None) -> W8A8Linear:
        """Quantize ``linear``'s weight (times ``smooth``, per input channel, when given)."""
        weight = linear.weight.detach().float()
        return cls(quantize_int8(weight if smooth is None else weight * smooth), linear.bias, smooth)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.float() if self.smooth is None else x.float() / self.smooth
        return (fake_quant_per_token(flat) @ self.dequantized_weight().T).to(x.dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The codes' values (of ``W · s`` when smoothed): what the simulated matmul multiplies by."""
        return (self.codes.float() * self.scales[:, None]).to(dtype)

    def extra_repr(self) -> str:
        smooth = "smoothed" if self.smooth is not None else "plain"
        return f"{super().extra_repr()}, simulated, {smooth}"


@contextmanager
def _input_hooks(model: nn.Module, names: set[str], record) -> Iterator[None]:
    handles = [
        module.register_forward_pre_hook(lambda _m, args, name=name: record(name, args[0]))
        for name, module in model.named_modules()
        if name in names
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def projection_names(model: nn.Module) -> list[str]:
    """The decoder projections W8A8 changes, in the model's order (the head and the router stay)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS
    ]


@torch.inference_mode()
def input_channel_max(model: nn.Module, token_ids: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Per layer in ``names``, the largest magnitude each input channel took (``[in]``) while the model read
    ``token_ids`` (``[tokens]``, one sequence, nothing cached)."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        channel_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        maxima[name] = channel_max if name not in maxima else torch.maximum(maxima[name], channel_max)

    with _input_hooks(model, set(names), record):
        model.logits_without_cache(token_ids)
    return maxima


def smoothing_scales(activation_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's ``s_j = max|X_j|^α / max|W_j|^(1−α)`` per input channel j (``weight`` is ``[out, in]``)."""
    weight_max = weight.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (activation_max.clamp(min=1e-5) ** alpha / weight_max ** (1 - alpha)).clamp(min=1e-5)


def quantize_w8a8(
    model: nn.Module, calibration_ids: torch.Tensor | None = None, alpha: float | None = None
) -> dict[str, torch.Tensor]:
    """Swap every decoder projection for a :class:`W8A8Linear`, and the head for int8 weights with 16-bit
    inputs (:class:`~.linear.Int8Linear`, as under every weight scheme of :mod:`.swap`), in place. With
    ``alpha`` (and the ``calibration_ids`` its scales are measured on), SmoothQuant's migration first.
    Returns the calibration's per-channel input maxima (empty without smoothing)."""
    names = projection_names(model)
    maxima = {}
    if alpha is not None:
        if calibration_ids is None:
            raise ValueError("SmoothQuant measures its scales on calibration tokens: pass calibration_ids")
        maxima = input_channel_max(model, calibration_ids, names)
    modules = dict(model.named_modules())
    head = modules.get("lm_head")
    if isinstance(head, nn.Linear):  # the head in int8 weights, 16-bit inputs, as every other scheme keeps it
        model.lm_head = Int8Linear.from_linear(head)
    for name in names:
        linear = modules[name]
        smooth = None if alpha is None else smoothing_scales(maxima[name], linear.weight, alpha)
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent], leaf, W8A8Linear.from_linear(linear, smooth))
    return maxima

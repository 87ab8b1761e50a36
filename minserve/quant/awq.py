"""Activation-aware int4 (AWQ-style): scale up the weight columns that meet large inputs before rounding.

Round-to-nearest treats every weight of a group alike, but what a weight's rounding error costs the
layer's output is that error times the input it meets: a column whose input channel runs ten times larger
than its neighbours' costs ten times more. AWQ (Lin et al., 2023) protects those columns without keeping
any weight in higher precision. For any positive scale ``s`` per input channel,

    y = x Wᵀ = (x / s) (W · s)ᵀ        exactly,

so a layer may quantize ``W · s`` instead of ``W`` and take ``x / s`` as its input. A column scaled up keeps
more of its precision (its group's step is set by the group's largest weight, which grows less than the
column does), and dividing its input by ``s`` again leaves the product unchanged: the columns that meet
large inputs come out more precise, the others a little less.

Here ``s = mean|x|^α`` over calibration tokens, normalized so its geometric middle is 1, with one ``α`` per
layer chosen from a grid for the quantized layer whose output on those tokens is closest to the float
layer's (:func:`search_input_scales`). ``α = 0`` is plain round-to-nearest, so on its own data the search
never does worse; whether it does better on other text is what chapter 07 measures.

The division by ``s`` costs nothing when serving: it is folded into whatever writes the layer's input
(:func:`fold_input_scales`), so the quantized modules are the ordinary :class:`~.linear.Int4Linear`:

* ``qkv_proj`` reads the attention norm's output: the norm's weight is divided by ``s``;
* ``gate_up_proj`` reads the MLP norm's output: likewise;
* ``down_proj`` reads ``silu(gate) · up``: the ``up`` rows of ``gate_up_proj`` are divided by ``s`` (a scale
  on one factor of a product passes straight through it); scaling whole rows scales their groups' steps
  with them, so ``gate_up_proj``'s own quantization is unchanged by it;
* ``o_proj`` reads attention's output, a mix of ``v`` rows. Under grouped-query attention one ``v`` row feeds
  the channels of several query heads, which would all need one scale, so ``o_proj`` (like the head, and
  like AutoAWQ does under GQA) keeps round-to-nearest.

What the paper adds and this module does not: a search of each group's clipping range after the scales.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minserve.quant.formats import quantize_int4

SCALED_PROJECTIONS = ("qkv_proj", "gate_up_proj", "down_proj")  # what a fold can reach; see the docstring
ALPHA_GRID = tuple(i / 10 for i in range(11))  # α = 0 … 1: 0 is round-to-nearest


def search_input_scales(
    model: nn.Module,
    token_ids: torch.Tensor,
    group_size: int,
    names: set[str],
    alphas: tuple[float, ...] = ALPHA_GRID,
) -> dict[str, torch.Tensor]:
    """For each projection in ``names`` (module names; those of :data:`SCALED_PROJECTIONS` count), the
    ``[in_features]`` float32 scale whose int4 rounding (groups of ``group_size``) best keeps the layer's
    output on ``token_ids``.

    One plain forward of the float model; each layer is searched as its input passes by, so no activations
    are kept beyond the layer being searched."""
    scales: dict[str, torch.Tensor] = {}

    def search(name: str, linear: nn.Linear, x: torch.Tensor) -> None:
        if name in names:
            scales[name] = best_scale(linear.weight.detach().float(), x.reshape(-1, x.shape[-1]).float(),
                                      group_size, alphas)  # fmt: skip

    with _inputs_seen(model, search):
        model.logits_without_cache(token_ids)
    return scales


def best_scale(weight: torch.Tensor, inputs: torch.Tensor, group_size: int, alphas: tuple[float, ...]) -> torch.Tensor:
    """The ``s = mean|x|^α`` (``[in]``) of the α in ``alphas`` whose quantized ``W · s``, used as ``(x / s)``
    times it, gives the smallest mean squared output error on ``inputs`` ``[tokens, in]``."""
    magnitude = inputs.abs().mean(dim=0).clamp(min=1e-8)
    errors = {alpha: output_error(weight, inputs, _normalized(magnitude**alpha), group_size) for alpha in alphas}
    best = min(errors, key=errors.__getitem__)
    return _normalized(magnitude**best)


def output_error(weight: torch.Tensor, inputs: torch.Tensor, scale: torch.Tensor, group_size: int) -> float:
    """Mean squared difference between ``inputs @ weightᵀ`` and what the int4 layer of ``weight · scale``
    gives for ``inputs / scale``: the same as ``inputs`` times the weight error ``W − Q(W · s) / s``."""
    effective = quantize_int4(weight * scale, group_size).dequantize() / scale
    return float(((inputs @ (weight - effective).T) ** 2).mean())


def fold_input_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Make each scaled projection compute the same output as before from an input divided by its scale:
    its weight's columns times ``s``, the op that writes its input divided by ``s`` (the module docstring
    says which). Exact in real arithmetic; the float weights round once more in their own dtype."""
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}."
        attention_scale = scales.get(prefix + "self_attn.qkv_proj")
        if attention_scale is not None:
            _scale_columns(layer.self_attn.qkv_proj, attention_scale)
            _divide(layer.input_layernorm.weight, attention_scale)
        mlp_scale = scales.get(prefix + "mlp.gate_up_proj")
        if mlp_scale is not None:
            _scale_columns(layer.mlp.gate_up_proj, mlp_scale)
            _divide(layer.post_attention_layernorm.weight, mlp_scale)
        down_scale = scales.get(prefix + "mlp.down_proj")
        if down_scale is not None:
            _scale_columns(layer.mlp.down_proj, down_scale)
            up_rows = layer.mlp.gate_up_proj.weight[layer.mlp.intermediate_size :]
            _divide(up_rows, down_scale[:, None])


def _normalized(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` over the geometric mean of its extremes: the middle channel stays near 1, so neither the
    weights nor the inputs drift far from their float range."""
    return scale / (scale.max() * scale.min()).sqrt()


def _scale_columns(linear: nn.Linear, scale: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight.copy_(linear.weight.float() * scale.to(linear.weight.device))


def _divide(tensor: torch.Tensor, scale: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.copy_(tensor.float() / scale.to(tensor.device))


@contextmanager
def _inputs_seen(model: nn.Module, see) -> Iterator[None]:
    """Call ``see(name, module, input)`` for each scaled projection's input during forwards inside."""
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in SCALED_PROJECTIONS:
            hook = (lambda n: lambda mod, args: see(n, mod, args[0]))(name)
            handles.append(module.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

"""Quantize a loaded model by swapping its linear layers for quantized ones, one layer at a time.

Which layers change: every projection of every decoder layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) takes the scheme's format, and the output head ``lm_head`` takes int8 under every scheme. The
head is the largest single matrix of a small model (a fifth of SmolLM2-135M's weights) and is read whole
every decode step, so it wants a format with a fast kernel wherever the engine runs (int8's, on the CPU:
fp8 has none there), and like llama.cpp's quantized files it keeps more bits than the layers under int4.
The token embedding and the norms stay in full precision: a decode step reads one embedding row per token,
so narrowing it would save memory but hardly any bytes moved. (With tied embeddings the head's int8 copy
is extra memory beside the float embedding; :func:`weight_bytes` counts both.)

In a mixture of experts every expert is an MLP, so its ``gate_up_proj`` and ``down_proj`` take the format
like any other; the router (``gate``) is no ``nn.Linear`` and stays in full precision: it is tiny, and its
rounding would change which experts a token visits. ``int4-awq`` is refused there: it folds its scales into
the norm in front of the MLP, which the router and every expert read alike.

int4 groups 64 inputs by default: torch's CPU kernel takes groups of 32, 64, 128 or 256, and SmolLM2's
576-wide hidden size is a multiple of 64 but not of 128. A layer that no group size tiles keeps int8.
``int4-awq`` is int4 with its rounding made activation-aware first (:mod:`.awq`).

Each layer is quantized and its float weight dropped before the next is touched, so the model is never
held twice in full precision: the peak is the float model plus one layer's codes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from minserve.quant.awq import SCALED_PROJECTIONS, fold_input_scales, search_input_scales
from minserve.quant.formats import (
    FP8_DTYPE,
    GROUP_SIZES,
    WEIGHT_FORMATS,
    QuantizationError,
    check_group_size,
    quantize,
)
from minserve.quant.gguf_blocks import BLOCK as STORED_BLOCK
from minserve.quant.gguf_blocks import stored_int4_weights
from minserve.quant.linear import QUANTIZED_LINEARS, QuantizedLinear
from minserve.quant.row_switch import RowSwitchedLinear, dense_dtype, dense_twin, tune_row_switches

LAYER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
logger = logging.getLogger(__name__)
DEFAULT_GROUP_SIZE = 64  # int4, from float weights
INT4_OUTPUT_TILE = 16  # the CPU int4 packing takes output features in multiples of this
HEAD_FORMAT = "int8"
ACTIVATION_AWARE = "int4-awq"  # int4 with AWQ-style input scales searched on calibration tokens (:mod:`.awq`)
QUANTIZATIONS = (*WEIGHT_FORMATS, ACTIVATION_AWARE)


@dataclass(frozen=True)
class QuantScheme:
    """A weight format for the decoder layers, the int4 group size, the head's format (None: kept),
    whether int4's rounding is activation-aware (:mod:`.awq`), and whether each quantized layer keeps a
    dense float copy for steps of many rows (:mod:`.row_switch`; what ``quantization="auto"`` picks on a
    CPU, see :mod:`.auto`)."""

    format: str
    group_size: int | None = None  # int4: None picks 32 on a GGUF file's 4-bit blocks, else DEFAULT_GROUP_SIZE
    head_format: str | None = None
    activation_aware: bool = False
    keep_dense: bool = False

    @classmethod
    def named(cls, name: str, group_size: int | None = None) -> QuantScheme:
        """``"int8"``, ``"int4"``, ``"int4-awq"`` or ``"fp8"``, with the head in :data:`HEAD_FORMAT`."""
        if name not in QUANTIZATIONS:
            raise QuantizationError(f"unknown quantization {name!r}; use one of none, {', '.join(QUANTIZATIONS)}")
        if name == ACTIVATION_AWARE:
            return dataclasses.replace(cls.named("int4", group_size), activation_aware=True)
        if name == "int4" and group_size is not None and group_size not in GROUP_SIZES:
            raise QuantizationError(
                f"int4 group size {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}; choose one of them"
            )
        if name == "fp8" and FP8_DTYPE is None:
            raise QuantizationError(f"fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: use int8")
        return cls(name, group_size, HEAD_FORMAT)

    @classmethod
    def from_label(cls, label: str) -> QuantScheme:
        """The inverse of :attr:`label`: ``"int8"``, ``"fp8"``, ``"int4-g32"``, ``"int4-awq-g32"`` (no ``-g``:
        the default group)."""
        name, _, group = label.partition("-g")
        return cls.named(name, int(group)) if group else cls.named(name)

    @property
    def name(self) -> str:
        """The name :meth:`named` takes: the format, or :data:`ACTIVATION_AWARE`."""
        return ACTIVATION_AWARE if self.activation_aware else self.format

    @property
    def label(self) -> str:
        if self.format != "int4":
            return self.format
        return self.name if self.group_size is None else f"{self.name}-g{self.group_size}"


def quantize_model(
    model: nn.Module,
    scheme: QuantScheme,
    checkpoint: Path | None = None,
    calibration_ids: torch.Tensor | None = None,
    progress: bool = False,
) -> nn.Module:
    """Swap ``model``'s projections (and head) for :mod:`minserve.quant.linear` modules, in place.

    Under int4, a GGUF ``checkpoint`` whose layers are stored in Q4_0 / Q4_1 blocks gives those layers its
    blocks as they are (:mod:`.gguf_blocks`) when the group size is 32 or left to choose; every other layer
    is quantized from its float weight. Every group size is checked against every layer before any layer
    changes, so an impossible scheme fails with the model untouched, naming the layer and the sizes that fit.

    An activation-aware scheme searches its input scales on ``calibration_ids`` (``[tokens]``, on the model's
    device) first and folds them into the float model (:mod:`.awq`); it quantizes every layer from its
    float weight, a GGUF file's stored blocks included, since the scales change what is rounded.
    """
    if scheme.activation_aware and model.config.moe_layers:
        raise QuantizationError(
            f"{ACTIVATION_AWARE} folds its scales into the norm in front of the MLP, which a mixture of experts' "
            "router and experts all read: it is not supported for this model; use int4, int8 or fp8"
        )
    stored = {}
    keep_stored = scheme.format == "int4" and not scheme.activation_aware and scheme.group_size in (None, STORED_BLOCK)
    if keep_stored and checkpoint is not None:
        stored = stored_int4_weights(checkpoint, model.config)
    group_size = scheme.group_size or (STORED_BLOCK if stored else DEFAULT_GROUP_SIZE)
    targets = _targets(model, dataclasses.replace(scheme, group_size=group_size))
    if scheme.activation_aware:
        _fold_activation_scales(model, targets, group_size, calibration_ids)
    activation_dtype = next(model.parameters()).dtype
    for name, linear, format in tqdm(targets, desc=f"quantizing to {scheme.label}", disable=not progress):
        stored_blocks = format == "int4" and name in stored
        weight = stored[name] if stored_blocks else quantize(linear.weight.detach(), format, group_size)
        quantized = QUANTIZED_LINEARS[format](weight, linear.bias)
        if scheme.keep_dense:
            quantized = RowSwitchedLinear(quantized, dense_twin(weight, linear.bias, dense_dtype(activation_dtype)))
        _replace(model, name, quantized)
    if scheme.keep_dense:
        for format, rows in tune_row_switches(model, activation_dtype).items():
            logger.info("%s codes for steps of up to %d rows, the dense copies above", format, rows)
    return model


def _fold_activation_scales(
    model: nn.Module, targets: list[tuple[str, nn.Linear, str]], group_size: int, calibration_ids: torch.Tensor | None
) -> None:
    if calibration_ids is None:
        raise QuantizationError(f"{ACTIVATION_AWARE} searches its scales on calibration tokens: pass calibration_ids")
    names = {name for name, _, format in targets if format == "int4" and name.rsplit(".", 1)[-1] in SCALED_PROJECTIONS}
    fold_input_scales(model, search_input_scales(model, calibration_ids, group_size, names))


def _targets(model: nn.Module, scheme: QuantScheme) -> list[tuple[str, nn.Linear, str]]:
    """(name, layer, format) for every layer the scheme changes."""
    targets = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Linear):
            continue
        format = scheme.format if leaf in LAYER_PROJECTIONS else scheme.head_format if leaf == "lm_head" else None
        if format == "int4":
            format = _int4_or_fallback(name, module, scheme.group_size)
        if format is not None:
            targets.append((name, module, format))
    return targets


def _int4_or_fallback(name: str, linear: nn.Linear, group_size: int) -> str:
    """int4 where ``group_size`` tiles the layer's inputs. Where no group size the kernels take could (the
    tiny model's 688-wide ``down_proj``), or the outputs are not a multiple of 16 (the CPU packing's tile),
    the layer keeps int8, as llama.cpp keeps a higher type for rows its blocks do not tile; where another
    group size would do, the scheme is refused, naming it."""
    in_features = linear.in_features
    if linear.out_features % INT4_OUTPUT_TILE or not any(in_features % g == 0 for g in GROUP_SIZES):
        logger.info("%s: int4 cannot tile its %s weight; it is stored in int8", name, tuple(linear.weight.shape))
        return "int8"
    try:
        check_group_size(in_features, group_size)
    except QuantizationError as error:
        raise QuantizationError(f"{name}: {error}") from None
    return "int4"


def layer_formats(model: nn.Module) -> dict[str, str]:
    """Each linear layer's storage, by name: a quantized format, the float dtype it kept, or both
    (``"int4+float32"``: :class:`~minserve.quant.row_switch.RowSwitchedLinear`)."""
    formats = {}
    for name, module in _linear_layers(model):
        formats[name] = module.format if isinstance(module, (QuantizedLinear, RowSwitchedLinear)) else (
            str(module.weight.dtype).removeprefix("torch."))  # fmt: skip
    return formats


def _linear_layers(model: nn.Module):
    """(name, module) for every linear layer: a float ``nn.Linear``, a quantized one, or a row-switched
    pair (whose two halves are one layer, not two)."""
    inside_pairs: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside_pairs:
            continue
        if isinstance(module, RowSwitchedLinear):
            inside_pairs.update((id(module.narrow), id(module.dense)))
            yield name, module
        elif isinstance(module, (QuantizedLinear, nn.Linear)):
            yield name, module


def describe_weights(model: nn.Module) -> str:
    """The formats a model's linear layers are held in, for a person: ``"int4+float32 ×120, int8+float32
    (lm_head); int4 codes up to 16 rows a step, float32 above"``."""
    formats = layer_formats(model)
    head = formats.pop("lm_head", None)
    counts: dict[str, int] = {}
    for format in formats.values():
        counts[format] = counts.get(format, 0) + 1
    parts = [f"{format} ×{count}" for format, count in counts.items()]
    if head is not None:
        parts.append(f"{head} (lm_head)")
    switches = {m.max_narrow_rows for m in model.modules() if isinstance(m, RowSwitchedLinear)}
    rule = f"; codes up to {'/'.join(map(str, sorted(switches)))} rows a step, dense above" if switches else ""
    return ", ".join(parts) + rule


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``name`` is. It takes over the old layer's forward hooks: a tensor-parallel
    layer's collective rides on one (:mod:`minserve.parallel.sharding`), and must survive quantization."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    for hook in getattr(parent, leaf)._forward_hooks.values():
        module.register_forward_hook(hook)
    setattr(parent, leaf, module)  # the old Linear (and its float weight, unless tied) is released


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy: parameters at their dtype, quantized layers as stored (codes at
    their bit width, scales and zeros); a tensor shared by two modules (tied embeddings) counted once."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total + sum(m.weight_nbytes for m in model.modules() if isinstance(m, QuantizedLinear))


def linear_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, weights) of every linear layer, the head included: what one decode step reads of the model
    (the embedding gives one row a token, so it is left out). Their ratio × 8 is the bits per weight."""
    total_bytes = total_weights = 0
    for _, module in _linear_layers(model):
        if isinstance(module, RowSwitchedLinear):  # a decode step reads the codes
            module = module.narrow
        if isinstance(module, QuantizedLinear):
            total_bytes += module.weight_nbytes
            total_weights += module.in_features * module.out_features
        elif isinstance(module, nn.Linear):
            total_bytes += module.weight.numel() * module.weight.element_size()
            total_weights += module.weight.numel()
    return total_bytes, total_weights


def format_options(label: str) -> dict[str, str | int | None]:
    """A storage label → LLM's keywords: ``"int4-g32+kv-int8"`` → ``quantization``, ``quant_group_size``,
    ``kv_cache_dtype``. A part is a weight format (:meth:`QuantScheme.from_label`) or ``kv-`` and a KV
    cache dtype; chapter 07, the quality comparison and the benchmarks all name formats so. A label with no
    weight format keeps the weights in float (``quantization="none"``); ``"auto"`` is the engine's default."""
    options: dict[str, str | int | None] = {"quantization": "none"}
    for part in label.split("+"):
        if part.startswith("kv-"):
            options["kv_cache_dtype"] = part.removeprefix("kv-")
        elif part == "auto":  # the engine's default (:mod:`.auto`)
            options["quantization"] = "auto"
        else:
            scheme = QuantScheme.from_label(part)
            options |= {"quantization": scheme.name, "quant_group_size": scheme.group_size}
    return options

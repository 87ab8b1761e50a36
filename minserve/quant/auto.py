"""``quantization="auto"``: the weight format an engine picks from its device and its checkpoint.

On a CPU, single-stream decode is bound by reading the weights (chapter 03), so the fewer bytes a weight
the faster, and a GGUF file stored in 4-bit blocks already has the format that reads fewest: its Q4_0 /
Q4_1 blocks load into int4 exactly as stored (:mod:`.gguf_blocks`), where dequantizing them to float32 would
make every decode step read eight times the bytes for the same weights. Prefill and large batches are
bound by arithmetic instead, where the int4 kernel is slower than a float GEMM, so each layer also keeps
its dense float copy for steps of many rows (:mod:`.row_switch`). The head stays in int8, the type such
files store it in (Q8_0).

Everything else keeps its weights as the checkpoint has them: safetensors in ``dtype``; any checkpoint on a
GPU, whose Triton kernels and bandwidth are another trade (chapter 07); and any run that names its
``dtype``, since a dtype asked for is the precision a user expects the weights to compute in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from minserve.quant.gguf_blocks import stores_int4_layers
from minserve.quant.swap import QuantScheme

AUTO = "auto"


def choose_scheme(
    quantization: str, group_size: int | None, checkpoint: Path, device: torch.device, dtype_asked: str
) -> QuantScheme | None:
    """The scheme ``quantization`` means here: ``"none"`` is None, a named format is that format, and
    ``"auto"`` is int4 with dense copies on a CPU serving a 4-bit GGUF file at ``dtype_asked == "auto"``,
    else None (see the module's docstring)."""
    if quantization == "none":
        return None
    if quantization != AUTO:
        return QuantScheme.named(quantization, group_size)
    if device.type == "cpu" and dtype_asked == AUTO and stores_int4_layers(checkpoint):
        return dataclasses.replace(QuantScheme.named("int4", group_size), keep_dense=True)
    return None

"""A GGUF file's 4-bit blocks taken as they are stored, instead of dequantized and quantized again.

llama.cpp's Q4_1 keeps, for every 32 consecutive weights of a row, a float16 scale ``d``, a float16 minimum
``m`` and 32 four-bit codes ``q``: the weight is ``q·d + m``. That is exactly minserve's int4 format with
groups of 32 (:mod:`minserve.quant.formats`): scale ``d``, and ``m + 8d`` as the value of the middle code.
Q4_0 is the symmetric case, ``(q − 8)·d``, whose middle code is worth 0. So a Q4_1 or Q4_0 file loads into
:class:`~minserve.quant.linear.Int4Linear` with no rounding of its own, where quantizing the dequantized
weights again would land them on a second, misaligned grid (chapter 07 measures what that costs).

What is not carried over exactly: the kernel holds scales in bfloat16, not float16 (3 fewer mantissa bits,
about 0.2% of a group's range), and other block types (Q8_0's 32-weight int8 blocks, the K-quants) have no
matching kernel here, so those tensors are dequantized and quantized like any float weight.

A block's 16 code bytes hold weight ``j`` in the low nibble of byte ``j`` and weight ``j + 16`` in its high
nibble.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor

from minserve.model.config import ModelConfig
from minserve.model.gguf import hf_tensor_name, is_gguf_file, open_gguf, unpermute_rotary_rows
from minserve.model.loader import minserve_name, shard_sizes
from minserve.quant.formats import INT4_MIDDLE, QuantizedWeight

BLOCK = 32  # weights per Q4_0 / Q4_1 block: the int4 group size that keeps them as stored
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


def stores_int4_layers(path: Path) -> bool:
    """Whether ``path`` is a GGUF file whose every decoder projection is stored in Q4_0 / Q4_1 blocks (read
    from the file's tensor table alone; no weight is read)."""
    if not is_gguf_file(path):
        return False
    types = [t.tensor_type for t in open_gguf(path).tensors if _is_projection(hf_tensor_name(t.name))]
    return bool(types) and all(t in _BLOCK_BYTES for t in types)


def _is_projection(hf_name: str | None) -> bool:
    """A decoder layer's matrix (``model.layers.3.mlp.up_proj.weight``), not its norms."""
    return hf_name is not None and hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight")


def stored_int4_weights(path: Path, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """For each decoder projection of a GGUF checkpoint whose every part is Q4_0 or Q4_1: its int4 weight (groups of
    32), by minserve module name (``layers.0.self_attn.qkv_proj``), fused parts stacked in order. Any other
    checkpoint, or a layer with another block type in it, is left out (empty for safetensors)."""
    if not is_gguf_file(path):
        return {}
    parts: dict[str, dict[int | None, QuantizedWeight | None]] = {}
    for tensor in open_gguf(path).tensors:
        hf_name = hf_tensor_name(tensor.name)
        if not _is_projection(hf_name):
            continue  # norms, the embedding and the head: the swap gives the head int8
        name, shard = minserve_name(hf_name)
        weight = _as_int4(tensor) if tensor.tensor_type in _BLOCK_BYTES else None
        if weight is not None and ".q_proj." in hf_name:
            weight = _rows_unpermuted(weight, config.num_heads)
        elif weight is not None and ".k_proj." in hf_name:
            weight = _rows_unpermuted(weight, config.num_kv_heads)
        parts.setdefault(name.removesuffix(".weight"), {})[shard] = weight
    stored = {}
    for module, shards in parts.items():
        expected = len(shard_sizes(config, module)) if None not in shards else 1
        if len(shards) == expected and all(w is not None for w in shards.values()):
            stored[module] = _stacked([shards[k] for k in sorted(shards, key=lambda s: -1 if s is None else s)])
    return stored


def _as_int4(tensor: ReaderTensor) -> QuantizedWeight:
    """One Q4_0 / Q4_1 tensor's blocks as int4 codes, scales and middle-code values, ``[out, in]``."""
    out, inp = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists the fastest-varying dimension first
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out, inp // BLOCK, _BLOCK_BYTES[tensor.tensor_type])
    scales = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == GGMLQuantizationType.Q4_1:
        minimum = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros, code_bytes = minimum + INT4_MIDDLE * scales, raw[..., 4:]
    else:
        zeros, code_bytes = np.zeros_like(scales), raw[..., 2:]
    codes = np.concatenate([code_bytes & 0xF, code_bytes >> 4], axis=-1).reshape(out, inp)
    return QuantizedWeight("int4", torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros), BLOCK)


def _rows_unpermuted(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """llama.cpp's q/k row order undone (see :func:`unpermute_rotary_rows`): rows carry their groups along."""
    assert weight.zeros is not None
    return QuantizedWeight(
        "int4",
        unpermute_rotary_rows(weight.codes, num_heads),
        unpermute_rotary_rows(weight.scales, num_heads),
        unpermute_rotary_rows(weight.zeros, num_heads),
        BLOCK,
    )


def _stacked(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused parts (q, k, v or gate, up) one above the other, as the fused layer's rows are."""
    if len(weights) == 1:
        return weights[0]
    return QuantizedWeight(
        "int4",
        torch.cat([w.codes for w in weights]),
        torch.cat([w.scales for w in weights]),
        torch.cat([w.zeros for w in weights if w.zeros is not None]),
        BLOCK,
    )

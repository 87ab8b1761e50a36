"""Read a GGUF file, llama.cpp's one-file checkpoint: metadata, tokenizer and weights together.

A GGUF file holds typed key/value metadata (``llama.block_count = 30``, the tokenizer's vocabulary, the
chat template, …), a table of tensors (name, shape, element type), then the tensor data, most of it
quantized in blocks (Q4_1: 32 weights share one float16 scale and one float16 minimum). The ``gguf``
package, llama.cpp's own Python reader, parses the file and dequantizes the blocks. This module maps what
it finds onto minserve: the metadata onto a :class:`ModelConfig` (by way of the Hugging Face config dict
it would have been converted from) and llama.cpp's tensor names onto the Hugging Face names
:func:`minserve.model.loader.load_model` already knows how to place, fusing q/k/v and gate/up.

Two things differ from a Hugging Face checkpoint:

* llama.cpp's rotary embedding rotates adjacent pairs of a head, (x0, x1), (x2, x3), …; Hugging Face's and
  minserve's rotate element i with element i + head_dim/2. llama.cpp's converter reordered the rows of the
  q and k projections to make its pairing compute the same thing; :func:`unpermute_rotary_rows` puts them
  back.
* The weights are dequantized to float32 once, at load, and the model computes in ordinary float32 or
  bfloat16: a 4-bit file is small on disk, not in memory.

Only the ``llama`` architecture is read (Llama 2 and 3, Mistral 7B and SmolLM are converted under it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from minserve.model.config import ModelConfig, ModelConfigError
from minserve.model.errors import CheckpointError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp tensor name → Hugging Face name. Per layer: blk.<i>.<part>.<weight|bias>.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)$")
_FLOAT_TYPES = {
    GGMLQuantizationType.F32: "float32",
    GGMLQuantizationType.F16: "float16",
    GGMLQuantizationType.BF16: "bfloat16",
}


@dataclass(frozen=True)
class GGUFFile:
    """One parsed GGUF file: its metadata as plain Python values, its tensors as views into the mapped file."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[ReaderTensor]

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def arch_value(self, key: str) -> Any:
        """An architecture-scoped key: ``arch_value("block_count")`` reads ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}")


def is_gguf_file(path: Path | str) -> bool:
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def open_gguf(path: Path | str) -> GGUFFile:
    """Parse ``path`` once: the config, the tokenizer and the weights all read the same parse.

    Parsing is not free (a 49k-token vocabulary and its merges are ~100k small arrays, a few seconds here),
    so the last two files opened are kept, keyed by size and modification time so an edited file is re-read.
    """
    path = Path(path).resolve()
    stat = path.stat()
    return _open_cached(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size_bytes: int, mtime_ns: int) -> GGUFFile:
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{path.name} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as error:  # what numpy says when the data runs out early
        raise CheckpointError(
            f"{path.name} ({size_bytes} bytes) cannot be read as GGUF: {error}. Is the file truncated or corrupt? "
            "Download or copy it again."
        ) from error
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    return GGUFFile(path, metadata, list(reader.tensors))


def load_gguf_config(path: Path | str) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file's metadata describes, refusing what minserve cannot run."""
    file = open_gguf(path)
    try:
        return ModelConfig.from_hf(hf_config(file))
    except ModelConfigError as error:
        raise CheckpointError(f"{file.path.name}: {error}") from error


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict this file was converted from (as far as minserve needs it)."""
    name = file.path.name
    if file.architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{name}: GGUF architecture {file.architecture!r} is not supported; minserve reads GGUF files of "
            f"the {', '.join(SUPPORTED_ARCHITECTURES)} architecture (Llama 2/3, Mistral 7B, SmolLM, …)"
        )
    tensor_names = {t.name for t in file.tensors}
    _refuse_unsupported_features(file, tensor_names)
    heads = _positive_int(file, "attention.head_count")
    tokens = file.metadata.get("tokenizer.ggml.tokens") or []
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": file.arch_value("vocab_size") or len(tokens),
        "hidden_size": _positive_int(file, "embedding_length"),
        "intermediate_size": _positive_int(file, "feed_forward_length"),
        "num_hidden_layers": _positive_int(file, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _positive_int(file, "attention.head_count_kv", default=heads),
        "head_dim": file.arch_value("attention.key_length"),
        "max_position_embeddings": _positive_int(file, "context_length", default=2048),
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon") or 1e-5),
        "rope_theta": float(file.arch_value("rope.freq_base") or 10000.0),
        "rope_scaling": _rope_scaling(file),
        "tie_word_embeddings": "output.weight" not in tensor_names,  # no output matrix: reuse the embedding
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "eos_token_id": _end_token_ids(file),
        "bos_token_id": file.metadata.get("tokenizer.ggml.bos_token_id"),
        "torch_dtype": _checkpoint_dtype(file),
    }


def _refuse_unsupported_features(file: GGUFFile, tensor_names: set[str]) -> None:
    name = file.path.name
    if file.arch_value("expert_count"):
        raise CheckpointError(f"{name}: mixture-of-experts models (llama.expert_count) are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            f"{name}: per-frequency rotary factors (rope_freqs.weight, Llama 3.1-style rope scaling) are not "
            "supported from GGUF; load the Hugging Face checkpoint of this model instead"
        )
    rope_dims, key_length = file.arch_value("rope.dimension_count"), file.arch_value("attention.key_length")
    head_dim = key_length or _positive_int(file, "embedding_length") // _positive_int(file, "attention.head_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise CheckpointError(f"{name}: rotary over {rope_dims} of {head_dim} head dimensions is not supported")


def _positive_int(file: GGUFFile, key: str, default: int | None = None) -> int:
    value = file.arch_value(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(
            f"{file.path.name}: metadata {file.architecture}.{key} must be one positive integer, got {value!r}"
        )
    return value


def _rope_scaling(file: GGUFFile) -> dict[str, Any] | None:
    kind = file.arch_value("rope.scaling.type") or "none"
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(file.arch_value("rope.scaling.factor") or 1.0)}
    raise CheckpointError(f"{file.path.name}: rope scaling {kind!r} is not supported (minserve reads none, linear)")


def _end_token_ids(file: GGUFFile) -> list[int]:
    """End of sequence, and llama.cpp's end of turn / end of message where the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return list(dict.fromkeys(int(file.metadata[k]) for k in keys if file.metadata.get(k) is not None))


def _checkpoint_dtype(file: GGUFFile) -> str:
    """The dtype ``dtype="auto"`` picks on an accelerator: the matrices' own when they are all plain floats.

    Quantized blocks have no torch dtype; bfloat16 is then the choice (float32's range, half its memory).
    """
    matrix_types = {t.tensor_type for t in file.tensors if len(t.shape) == 2}
    if len(matrix_types) == 1 and next(iter(matrix_types)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(matrix_types))]
    return "bfloat16"


def iter_gguf_tensors(path: Path | str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized one at a time.

    The q and k projections come out in Hugging Face's row order (see :func:`unpermute_rotary_rows`).
    """
    file = open_gguf(path)
    for tensor in file.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise CheckpointError(
                f"{file.path.name}: tensor {tensor.name!r} has no place in a {file.architecture} model minserve knows"
            )
        values = torch.from_numpy(_dequantized(tensor, file.path))
        if ".q_proj." in name:
            values = unpermute_rotary_rows(values, config.num_heads)
        elif ".k_proj." in name:
            values = unpermute_rotary_rows(values, config.num_kv_heads)
        yield name, values


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_k.weight`` → ``model.layers.3.self_attn.k_proj.weight``; None for an unknown name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match["part"] not in _LAYER_PARTS:
        return None
    return f"model.layers.{match['layer']}.{_LAYER_PARTS[match['part']]}.{match['kind']}"


def _dequantized(tensor: ReaderTensor, path: Path) -> np.ndarray:
    """The tensor as a writable float32 array in row-major (PyTorch) shape."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise CheckpointError(
            f"{path.name}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the gguf package "
            "cannot dequantize; minserve loads F32, F16, BF16 and the block-quantized types it can (Q4_0, Q4_1, "
            "Q5_0, Q5_1, Q8_0, the K-quants Q2_K…Q6_K, the IQ types)"
        ) from error
    # GGUF lists the fastest-varying dimension first: a [out, in] matrix is stored with shape (in, out).
    values = values.reshape(tuple(int(n) for n in reversed(tensor.shape))).astype(np.float32, copy=False)
    return values if values.flags.writeable else values.copy()  # F32 comes back as a view of the read-only map


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order in a q or k projection (weight ``[num_heads * head_dim, in]`` or bias).

    llama.cpp pairs adjacent elements (2j, 2j + 1) of a head for rotation, minserve pairs (j, j + head_dim/2).
    The converter moved Hugging Face row ``t * head_dim/2 + j`` of each head to row ``2j + t``; reading the
    head's rows as a ``[head_dim/2, 2]`` grid and transposing it moves them back.
    """
    head_dim = weight.shape[0] // num_heads
    grid = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grid.transpose(1, 2).reshape(weight.shape)

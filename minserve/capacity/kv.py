"""KV-cache arithmetic: how many bytes each token, request and batch keeps on the accelerator.

Every layer stores one key and one value vector per KV head for every token in the context, so

    KV bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes per element.

Grouped-query attention shrinks it by sharing KV heads (Llama-3-8B: 8 KV heads for 32 query heads, a quarter
of Llama-2-7B's 32); the dtype scales it (fp8 halves bf16). A paged cache hands memory out in blocks of
``block_size`` tokens, so a sequence wastes less than one block, where a contiguous cache reserves
``max_model_len`` tokens for every sequence whatever its length.

All functions are pure; sizes are ``_bytes``, lengths are ``_tokens`` (or counts of blocks and sequences).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minserve.capacity.presets import model_preset
from minserve.model.config import ModelConfig

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
}

Dtype = str | int  # a name from DTYPE_BYTES, or the bytes per element itself
ModelLike = ModelConfig | Mapping[str, Any] | str  # a config, an HF config.json dict, or a preset's name


def dtype_bytes(dtype: Dtype) -> int:
    """Bytes per element: ``"bfloat16"`` → 2, ``"fp8"`` → 1; an int is taken as the byte count itself."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype <= 0:
            raise ValueError(f"bytes per element must be positive, got {dtype}")
        return dtype
    try:
        return DTYPE_BYTES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def model_config(model: ModelLike) -> ModelConfig:
    """A :class:`ModelConfig` from a config, an HF ``config.json`` dict, or a preset name like ``"Llama-3-8B"``."""
    if isinstance(model, ModelConfig):
        return model
    return ModelConfig.from_hf(model_preset(model) if isinstance(model, str) else dict(model))


# --- bytes per token, request and batch ---------------------------------------------------------------------


def kv_bytes_per_token(config: ModelConfig, dtype: Dtype = "bfloat16") -> int:
    """KV-cache bytes one token occupies across all layers: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return config.kv_bytes_per_token_per_layer_element * config.num_layers * dtype_bytes(dtype)


def kv_bytes_per_token_hf(hf: Mapping[str, Any], dtype: Dtype = "bfloat16") -> int:
    """The same from the four fields of an HF ``config.json`` that matter, for any dense-attention model.

    ``num_key_value_heads`` absent means full multi-head attention (as many KV heads as query heads);
    ``head_dim`` absent means ``hidden_size / num_attention_heads``.
    """
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    return 2 * int(hf["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes(dtype)


def kv_bytes_per_token_preset(name: str, dtype: Dtype = "bfloat16") -> int:
    """The same for a named preset (see :data:`minserve.capacity.presets.MODEL_PRESETS`)."""
    return kv_bytes_per_token_hf(model_preset(name), dtype)


def kv_bytes_per_request(config: ModelConfig, prompt_tokens: int, output_tokens: int, dtype: Dtype = "bfloat16") -> int:
    """KV bytes of one request at its end: every prompt and every output token stays cached."""
    return (prompt_tokens + output_tokens) * kv_bytes_per_token(config, dtype)


def kv_bytes_total(config: ModelConfig, context_tokens: int, concurrency: int, dtype: Dtype = "bfloat16") -> int:
    """KV bytes of ``concurrency`` sequences of ``context_tokens`` each: grows with the product of the two."""
    return context_tokens * concurrency * kv_bytes_per_token(config, dtype)


# --- paging: blocks, fragmentation, contiguous reservation --------------------------------------------------


def blocks_per_sequence(num_tokens: int, block_size_tokens: int) -> int:
    """Blocks a sequence of ``num_tokens`` needs: ⌈num_tokens / block_size⌉ (0 for an empty sequence)."""
    if block_size_tokens <= 0 or num_tokens < 0:
        raise ValueError(f"need block_size_tokens > 0 and num_tokens ≥ 0, got {block_size_tokens}, {num_tokens}")
    return -(-num_tokens // block_size_tokens)  # ceiling division on integers, no float rounding


def wasted_slots(num_tokens: int, block_size_tokens: int) -> int:
    """Internal fragmentation: token slots allocated but unused, in the last block only (< block_size)."""
    return blocks_per_sequence(num_tokens, block_size_tokens) * block_size_tokens - num_tokens


def paged_kv_bytes(
    config: ModelConfig, seq_lens_tokens: Sequence[int], block_size_tokens: int, dtype: Dtype = "bfloat16"
) -> int:
    """KV bytes a paged cache allocates for sequences of these lengths: whole blocks, per sequence."""
    slots = sum(blocks_per_sequence(n, block_size_tokens) for n in seq_lens_tokens) * block_size_tokens
    return slots * kv_bytes_per_token(config, dtype)


def contiguous_kv_bytes(
    config: ModelConfig, num_sequences: int, max_model_len_tokens: int, dtype: Dtype = "bfloat16"
) -> int:
    """KV bytes a contiguous cache reserves: ``max_model_len`` tokens per sequence, however short it is.

    Invariant: for sequences no longer than ``max_model_len`` and a ``max_model_len`` that is a whole number
    of blocks, :func:`paged_kv_bytes` ≤ this.
    """
    return num_sequences * max_model_len_tokens * kv_bytes_per_token(config, dtype)


def max_concurrent_sequences(
    config: ModelConfig,
    kv_budget_bytes: int,
    tokens_per_sequence: int,
    block_size_tokens: int = 16,
    dtype: Dtype = "bfloat16",
) -> int:
    """How many sequences of ``tokens_per_sequence`` fit in a KV budget, paged in blocks of ``block_size``.

    The budget is cut into whole blocks first (a block is the unit of allocation), then shared out.
    """
    if tokens_per_sequence <= 0:
        raise ValueError(f"tokens_per_sequence must be positive, got {tokens_per_sequence}")
    block_bytes = block_size_tokens * kv_bytes_per_token(config, dtype)
    num_blocks = max(kv_budget_bytes, 0) // block_bytes
    return num_blocks // blocks_per_sequence(tokens_per_sequence, block_size_tokens)

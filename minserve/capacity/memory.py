"""Does it fit? Weights plus KV cache against one accelerator's memory.

The weights take ``parameters × bytes per weight``; what is left of the usable memory is the KV budget. The
parameter count is estimated from the config (embeddings, per layer attention and MLP, LM head unless tied to
the embeddings), which for Llama-family models is exact up to a few norm vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.capacity.kv import (
    Dtype,
    ModelLike,
    blocks_per_sequence,
    dtype_bytes,
    kv_bytes_per_token,
    kv_bytes_total,
    max_concurrent_sequences,
    model_config,
)
from minserve.capacity.presets import gpu_memory_bytes
from minserve.model.config import ModelConfig

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # as in vLLM: the rest is for activations, the CUDA context, fragmentation


def attention_params(config: ModelConfig) -> int:
    """Weights of one layer's attention: q, k, v, o projections (+ biases and q/k norms where the model has them)."""
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    params = config.hidden_size * (q_width + 2 * kv_width) + q_width * config.hidden_size
    params += (q_width + 2 * kv_width) if config.qkv_bias else 0
    params += config.hidden_size if config.o_bias else 0
    params += 2 * config.head_dim if config.qk_norm else 0
    return params


def mlp_params(config: ModelConfig) -> int:
    """Weights of one layer's gated MLP: gate, up (hidden → intermediate) and down (intermediate → hidden)."""
    params = 3 * config.hidden_size * config.intermediate_size
    return params + (2 * config.intermediate_size + config.hidden_size if config.mlp_bias else 0)


def expert_params(config: ModelConfig) -> int:
    """Weights of one expert of a mixture-of-experts layer: a gated MLP ``moe_intermediate_size`` wide."""
    return 3 * config.hidden_size * config.moe_intermediate_size


def router_params(config: ModelConfig) -> int:
    """Weights of a mixture-of-experts layer's router: hidden → one score per expert."""
    return config.hidden_size * config.num_experts


def layer_mlp_params(config: ModelConfig, layer: int) -> int:
    """Weights of layer ``layer``'s feed-forward part as stored: the dense MLP, or every expert and the router."""
    if layer in config.moe_layers:
        return config.num_experts * expert_params(config) + router_params(config)
    return mlp_params(config)


def decoder_params(config: ModelConfig) -> int:
    """Weights of all decoder layers: attention, feed-forward (every expert of a sparse layer) and two norms."""
    per_layer = attention_params(config) + 2 * config.hidden_size
    return sum(per_layer + layer_mlp_params(config, layer) for layer in range(config.num_layers))


def estimate_params(config: ModelConfig) -> int:
    """Parameter count: embeddings + decoder layers + final norm + LM head unless tied. A mixture of experts
    counts every expert: all of them take memory, though a token multiplies by only its top-k."""
    embeddings = config.vocab_size * config.hidden_size
    lm_head = 0 if config.tie_word_embeddings else embeddings
    return embeddings + decoder_params(config) + config.hidden_size + lm_head


def weights_bytes(config: ModelConfig, dtype: Dtype = "bfloat16") -> int:
    """Bytes of the weights: parameters × bytes per weight."""
    return estimate_params(config) * dtype_bytes(dtype)


def weights_and_kv_bytes(model: ModelLike, batch: int, context_tokens: int, dtype: Dtype = "bfloat16") -> int:
    """Bytes of the weights plus ``batch`` sequences' KV of ``context_tokens`` each, in one ``dtype``.

    The plain sum, with no allowance for activations or block rounding: the least memory the work needs.
    :func:`fit` is the stricter check a deployment makes.
    """
    config = model_config(model)
    return weights_bytes(config, dtype) + kv_bytes_total(config, context_tokens, batch, dtype)


@dataclass(frozen=True)
class Fit:
    """One model on one accelerator at one context length and batch. All sizes in bytes."""

    gpu_bytes: int
    usable_bytes: int  # gpu_bytes × utilization
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int  # one sequence of context_tokens, rounded up to whole blocks
    kv_bytes: int  # the whole batch
    headroom_bytes: int  # usable − weights − KV; negative when it does not fit
    max_sequences: int  # how many such sequences the KV budget holds
    fits: bool


def fit(
    model: ModelLike,
    gpu: str | int,
    context_tokens: int,
    batch: int,
    dtype: Dtype = "bfloat16",
    kv_dtype: Dtype | None = None,
    block_size_tokens: int = 16,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> Fit:
    """Whether ``batch`` sequences of ``context_tokens`` fit beside the weights on ``gpu`` (a name or bytes).

    ``kv_dtype`` defaults to the weights' ``dtype``. Invariant: ``fits`` ⇔ ``batch ≤ max_sequences``.
    """
    config = model_config(model)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    gpu_bytes = gpu if isinstance(gpu, int) else gpu_memory_bytes(gpu)
    usable = int(gpu_bytes * gpu_memory_utilization)
    weights = weights_bytes(config, dtype)
    per_token = kv_bytes_per_token(config, kv_dtype)
    per_request = blocks_per_sequence(context_tokens, block_size_tokens) * block_size_tokens * per_token
    kv = batch * per_request
    return Fit(
        gpu_bytes=gpu_bytes,
        usable_bytes=usable,
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        kv_bytes=kv,
        headroom_bytes=usable - weights - kv,
        max_sequences=max_concurrent_sequences(config, usable - weights, context_tokens, block_size_tokens, kv_dtype),
        fits=weights + kv <= usable,
    )

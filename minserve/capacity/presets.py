"""Public numbers the capacity arithmetic runs on: model shapes and accelerator memory sizes.

Each model preset is the part of the model's Hugging Face ``config.json`` that sizes it (layer count, head
counts, widths, vocabulary), so any function that takes an HF config dict takes a preset too, and a learner
can paste a real ``config.json`` next to them. The numbers are the published ones; nothing here is derived.
"""

from __future__ import annotations

from typing import Any

# One base per family; each preset below overrides the sizes. "architectures" lets ModelConfig.from_hf
# read the dicts, exactly as it reads a downloaded config.json.
_LLAMA: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}
_MISTRAL: dict[str, Any] = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "torch_dtype": "bfloat16"}
_QWEN3: dict[str, Any] = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16"}
_MIXTRAL: dict[str, Any] = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "bfloat16"}
_QWEN3_MOE: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                              "torch_dtype": "bfloat16"}  # fmt: skip

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "Llama-2-7B": _LLAMA
    | {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,  # full multi-head attention: one K/V head per query head
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "Llama-2-13B": _LLAMA
    | {
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "Llama-2-70B": _LLAMA
    | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,  # Llama 2's only grouped-query model
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "Llama-3-8B": _LLAMA
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,  # grouped-query attention: 4 query heads share each K/V head
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "Llama-3-70B": _LLAMA
    | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "Mistral-7B": _MISTRAL
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    },
    "Qwen3-0.6B": _QWEN3
    | {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,  # explicit, and not hidden_size / num_attention_heads (= 64)
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "Qwen3-8B": _QWEN3
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
    },
    # Mixtures of experts: every expert takes memory, a token multiplies by its top-k.
    "Mixtral-8x7B": _MIXTRAL
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,  # each expert's width
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
    },
    "Qwen3-30B-A3B": _QWEN3_MOE
    | {
        "hidden_size": 2048,
        "intermediate_size": 6144,  # a dense layer's width; this model has none
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
    },
}

# Memory per accelerator in bytes, as sold (decimal gigabytes). The driver reports a little less usable
# memory, and the runtime needs some for itself; the fit helpers take a utilization fraction for that.
GB = 10**9
GPU_MEMORY_BYTES: dict[str, int] = {
    "L4 24GB": 24 * GB,
    "A100 80GB": 80 * GB,
    "H100 80GB": 80 * GB,
    "H200 141GB": 141 * GB,
    "B200 180GB": 180 * GB,  # the HGX B200 datasheet, per GPU
    "MI300X 192GB": 192 * GB,
}


def model_preset(name: str) -> dict[str, Any]:
    """A copy of the named preset's HF-style config dict (a copy, so callers may change it freely)."""
    try:
        return dict(MODEL_PRESETS[name])
    except KeyError:
        raise KeyError(f"no model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}") from None


def gpu_memory_bytes(name: str) -> int:
    """The named accelerator's memory in bytes."""
    try:
        return GPU_MEMORY_BYTES[name]
    except KeyError:
        raise KeyError(f"no GPU {name!r}; known: {', '.join(GPU_MEMORY_BYTES)}") from None

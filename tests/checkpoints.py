"""Tiny random Hugging Face checkpoints, built offline with transformers, one per supported family.

The mixtures of experts (Mixtral, Qwen3-MoE) have 4 experts, 2 per token; Qwen3-MoE once with every layer
sparse and the top-k left as the softmax gave them, once with a dense first layer and the top-k renormalised.

The tokenizer files are the embedded model's (vocab 2048), so every checkpoint is a complete, servable model
directory, just with random weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from minserve.model.loader import ASSETS_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 2048
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}

# name → (transformers config class name, extra config fields)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3.1-rope": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-attention-bias": ("LlamaConfig", {"attention_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 32, **QWEN3_MOE}),
    "qwen3-moe-dense-first": ("Qwen3MoeConfig", {**QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": [0]}),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe", "qwen3-moe-dense-first")
ROUTER_SCALE = 30.0  # random routers score every expert alike; scaled up, each token has clear favourites
_MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "MixtralConfig": "MixtralForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
}


def build_hf_model(family: str, seed: int = 0):
    """A transformers model of ``family`` with random weights (float32, eval mode)."""
    import transformers

    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[config_class])(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the parity test can see them.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # a router: without this, near-ties between experts
                param.mul_(ROUTER_SCALE)
    return model


def save_checkpoint(model, directory: Path, max_shard_size: str | None = None) -> Path:
    """``save_pretrained`` plus the embedded tokenizer files; returns ``directory``."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    for name in TOKENIZER_FILES:
        source = ASSETS_DIR / "minserve-tiny" / name
        if source.exists():
            shutil.copy(source, directory / name)
    return directory


def poisoned_copy(dest: Path, token_id: int, model: str = "minserve-tiny") -> Path:
    """A copy of an embedded model whose embedding row for ``token_id`` is NaN: any request holding that
    token gets NaN logits, a real failure inside one request that the engine must contain."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(ASSETS_DIR / model, dest)
    weights = load_file(dest / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone()  # untied, so the head stays sound for every other request
    embedding[token_id] = float("nan")
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return dest

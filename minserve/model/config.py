"""The shape of a Llama-family model, read from a Hugging Face ``config.json``.

One frozen dataclass covers Llama 2/3, Mistral, Qwen2 and Qwen3: they differ only in a few switches
(bias on the q/k/v projections, RMSNorm on q and k, an explicit head size, a rope scaling rule, a sliding
window). Mixtral and Qwen3-MoE are the same models with a mixture of experts in place of the MLP in some
layers (:class:`~minserve.model.llama.SparseMoE`): a few more fields say how many experts, how many a token
visits, how wide each is and which layers have them. Anything outside that family is refused here, before a
single tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# Config keys of mixture-of-experts designs minserve's SparseMoE does not compute (DeepSeek's and Qwen2-MoE's
# shared experts, grouped or sigmoid routing): a config carrying one of them describes another model.
UNSUPPORTED_MOE_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "topk_group", "scoring_func")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A config.json that minserve cannot serve; the message says which field and why."""


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (``rope_type`` as in transformers)."""

    rope_type: str = "default"
    factor: float = 1.0
    # Llama 3.1 only: frequencies between these wavelengths are interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint. Sizes are counts, not bytes."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias is set
    o_bias: bool = False  # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    sliding_window: int | None = None  # attend to at most this many most recent tokens
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    # Mixture of experts (Mixtral, Qwen3-MoE); a dense model keeps the defaults.
    num_experts: int = 0  # experts in each sparse layer
    num_experts_per_tok: int = 0  # top-k: the experts each token is sent to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (intermediate_size is the dense MLP's)
    norm_topk_prob: bool = False  # rescale a token's top-k router probabilities to sum to 1 (Mixtral: always)
    moe_layers: tuple[int, ...] = ()  # the decoder layers whose MLP is a mixture of experts

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The decoder layers with an ordinary MLP: every layer of a dense model."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def num_queries_per_kv(self) -> int:
        """Grouped-query attention: how many query heads share one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token_per_layer_element(self) -> int:
        """K and V elements one token adds to the cache in one layer (multiply by dtype bytes)."""
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict in a Hugging Face config.json, refusing what is not supported."""
        family = _family(hf)
        hidden, heads = _require_int(hf, "hidden_size"), _require_int(hf, "num_attention_heads")
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        rope_theta, rope_scaling = _rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={hf['hidden_act']!r} is not supported; minserve's MLP is SwiGLU (silu)")
        num_layers = _require_int(hf, "num_hidden_layers")
        return cls(
            family=family,
            vocab_size=_require_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require_int(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or (family in ("llama", "qwen3", "qwen3_moe") and attention_bias),
            o_bias=family in ("llama", "qwen3", "qwen3_moe") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=_sliding_window(hf, family),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            **(_mixture_of_experts(hf, family, num_layers) if family in MOE_FAMILIES else {}),
        )


def _family(hf: dict[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = hf.get("model_type")
    if not architectures and model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    found = ", ".join(architectures) or f"model_type={model_type!r}"
    raise ModelConfigError(f"unsupported architecture {found}; minserve serves {', '.join(SUPPORTED_ARCHITECTURES)}")


def _require_int(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Rotary settings from either the classic keys (rope_theta, rope_scaling) or transformers 5's
    single ``rope_parameters`` dict."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope scaling type {rope_type!r} is not supported; minserve supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling


def _sliding_window(hf: dict[str, Any], family: str) -> int | None:
    window = hf.get("sliding_window")
    if window is None:
        return None
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen carries a window in every config but applies it only with use_sliding_window, and then only
        # to some layers (max_window_layers); that per-layer rule is not implemented.
        if hf.get("use_sliding_window", False):
            raise ModelConfigError("use_sliding_window=true (per-layer sliding window) is not supported")
        return None
    if int(window) >= int(hf.get("max_position_embeddings", 2048)):
        return None  # the window never binds
    return int(window)


def _mixture_of_experts(hf: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig` for Mixtral and Qwen3-MoE.

    Mixtral: every layer sparse, experts as wide as ``intermediate_size``, the top-k renormalised. Qwen3-MoE:
    ``moe_intermediate_size`` wide, ``norm_topk_prob`` chooses the renormalisation, and layer ``i`` is sparse
    unless listed in ``mlp_only_layers`` or ``i + 1`` is no multiple of ``decoder_sparse_step`` (as
    transformers builds it); its other layers keep a dense MLP ``intermediate_size`` wide.
    """
    found = [key for key in UNSUPPORTED_MOE_KEYS if hf.get(key) not in (None, 0, "softmax")]
    if found:
        raise ModelConfigError(
            f"mixture-of-experts features {', '.join(found)} (shared experts, grouped or non-softmax routing) are "
            "not supported; minserve routes each token to its top-k of one set of experts by softmax"
        )
    experts = _require_int(hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    top_k = _require_int(hf, "num_experts_per_tok")
    if top_k > experts:
        raise ModelConfigError(f"num_experts_per_tok ({top_k}) must be at most the number of experts ({experts})")
    if family == "mixtral":
        width = _require_int(hf, "intermediate_size")
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                    norm_topk_prob=True, moe_layers=tuple(range(num_layers)))  # fmt: skip
    step = _require_int(hf, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
    dense = hf.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise ModelConfigError(f"mlp_only_layers {dense} must list layer indices from 0 to {num_layers - 1}")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_layers=sparse,
                moe_intermediate_size=_require_int(hf, "moe_intermediate_size"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))  # fmt: skip

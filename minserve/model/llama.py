"""The Llama family in one file: Llama 2/3, Mistral, Qwen2 and Qwen3, and Mixtral and Qwen3-MoE.

Read it top to bottom: RMSNorm, rotary embeddings, attention, the SwiGLU MLP, the mixture of experts that
replaces it in a sparse model, a decoder layer, the model. The families differ only in switches on
:class:`~minserve.model.config.ModelConfig` (q/k/v bias, q/k norm, head size, rope scaling, sliding window,
which layers hold experts), so there is one code path.

The model works on a *flat* batch: ``input_ids`` and ``positions`` are ``[num_tokens]`` tensors holding the
new tokens of every sequence in the step, and :class:`~minserve.model.attention.AttentionMetadata` says
where each sequence starts and where its keys and values live in the paged cache. Prefill, chunked prefill
and decode are therefore the same call.

The arithmetic between the matmuls (norms, rotary, SwiGLU's activation, attention) is the backend's: torch
or minserve's Triton kernels (:mod:`minserve.model.backends`), swapped with :meth:`set_backend`.

Two projections are fused for speed, as in vLLM and nano-vllm: q, k, v into one ``qkv_proj`` and gate, up
into one ``gate_up_proj`` (the checkpoint loader stacks the separate Hugging Face tensors into them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minserve.model.attention import AttentionMetadata
from minserve.model.backends import Rope, TorchBackend
from minserve.model.config import ModelConfig, RopeScaling

TORCH = TorchBackend()


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as the reference implementation does.

    ``forward(x, addend)`` also adds a residual first and returns ``(norm(x + addend), x + addend)``: the
    add and the norm are one fused kernel on the Triton backend.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.backend: TorchBackend = TORCH

    def forward(self, x: torch.Tensor, addend: torch.Tensor | None = None):
        normed, residual = self.backend.rms_norm(x, self.weight, self.eps, addend)
        return normed if addend is None else (normed, residual)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies (radians per position), with the checkpoint's scaling."""
    # Always on the CPU, even while the model is being built on the meta device.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the middle band interpolated.
        wavelength = 2 * math.pi / inv_freq
        old_context = scaling.original_max_position_embeddings
        smooth = (old_context / wavelength - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        long = wavelength > old_context / scaling.low_freq_factor
        short = wavelength < old_context / scaling.high_freq_factor
        inv_freq = torch.where(long, inv_freq / scaling.factor, torch.where(short, inv_freq, interpolated))
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Rotation frequencies for the "rotate half" layout; the angles are made per step (no table to keep)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, positions: torch.Tensor) -> Rope:
        """``[num_tokens]`` positions → the step's :class:`Rope` (its cos and sin are made when first asked)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return Rope(positions, self.inv_freq)


class Attention(nn.Module):
    """Grouped-query attention. ``kv_cache`` is set by whoever owns the memory (the engine), or left None."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.sliding_window = config.sliding_window
        self.scale = self.head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # [2, num_kv_heads] with an 8-bit cache
        self.backend: TorchBackend = TORCH

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.backend.apply_rotary(q, k, rope)
        out = self.backend.attention(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, self.kv_scales)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), ``intermediate_size`` wide (the config's, or an expert's)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.backend: TorchBackend = TORCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class TopKRouter(nn.Module):
    """Which experts each token goes to, and with what weight: softmax over the experts' scores, the top k
    kept, renormalised to sum to 1 where the config says so (Mixtral always; Qwen3-MoE by ``norm_topk_prob``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))  # the checkpoint's `gate`

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[tokens, hidden]`` → (weights ``[tokens, top_k]`` in x's dtype, expert ids ``[tokens, top_k]``)."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids


def run_grouped(experts: nn.ModuleList, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Each row of ``rows`` ``[n, hidden]`` through the expert ``expert_ids[row]`` (an index into ``experts``).

    Rows are sorted by expert, each expert runs once on its group (one matmul per expert, not per token; none
    for an expert no row chose), and the outputs are put back in the rows' order.
    """
    order = expert_ids.argsort(stable=True)
    group_sizes = torch.bincount(expert_ids, minlength=len(experts)).tolist()
    groups = rows[order].split(group_sizes)
    outputs = torch.empty_like(rows)
    outputs[order] = torch.cat([expert(group) if len(group) else group for expert, group in zip(experts, groups)])
    return outputs


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A token's experts' outputs ``[tokens * top_k, hidden]`` (pair ``p`` is token ``p // top_k``) added
    with its router weights ``[tokens, top_k]`` → ``[tokens, hidden]``."""
    return (outputs.view(*weights.shape, outputs.shape[-1]) * weights[..., None]).sum(dim=1)


class SparseMoE(nn.Module):
    """A mixture of experts in place of the MLP (Mixtral's ``block_sparse_moe``, Qwen3-MoE's ``mlp``).

    ``num_experts`` SwiGLU experts and a router; each token runs through only its ``top_k`` experts, and their
    outputs are added with the router's weights. So a token costs ``top_k`` experts' FLOPs while the layer
    holds ``num_experts`` of them: the weights grow, the work per token does not.

    ``tokens_per_expert`` counts the (token, expert) pairs routed to each expert since the model was built or
    last reset (:meth:`LlamaForCausalLM.reset_expert_load`): the load chapter 06 reads.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.gate = TopKRouter(config)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        # A plain attribute (like RotaryEmbedding.inv_freq), not a buffer: neither loaded nor cast with the weights.
        self.tokens_per_expert = torch.zeros(config.num_experts, dtype=torch.long, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)  # [tokens, top_k] each
        pair_experts = expert_ids.flatten()  # pair p: token p // top_k, its (p % top_k)-th expert
        self.count(pair_experts)
        outputs = run_grouped(self.experts, x.repeat_interleave(self.top_k, dim=0), pair_experts)
        return weighted_sum(outputs, weights)

    def count(self, pair_experts: torch.Tensor) -> None:
        """Add the routed (token, expert) pairs to :attr:`tokens_per_expert`."""
        routed = torch.bincount(pair_experts, minlength=self.num_experts)
        # Not in place: a counter made under inference_mode could not be added to outside it, nor the reverse.
        self.tokens_per_expert = self.tokens_per_expert.to(routed.device) + routed

    def reset_load(self) -> None:
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device="cpu")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); in a sparse layer the MLP is a
    mixture of experts."""

    def __init__(self, config: ModelConfig, sparse: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if sparse else MLP(config)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(rope, self.input_layernorm(x), meta)
        normed, x = self.post_attention_layernorm(x, attended)  # x + attended, and its norm, in one go
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Token ids in, hidden states out; :meth:`compute_logits` turns chosen rows into vocabulary scores."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i in config.moe_layers) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``[num_tokens]`` ids and positions → ``[num_tokens, hidden_size]`` final hidden states."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)  # shared by every layer
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` → ``[n, vocab_size]`` in float32 (sampling wants full precision)."""
        return self.lm_head(hidden).float()

    def set_backend(self, backend: TorchBackend) -> None:
        """Compute norms, rotations, activations and attention with ``backend`` (see :mod:`.backends`)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.backend = backend

    def expert_load(self) -> torch.Tensor:
        """``[moe layers, num_experts]``: the (token, expert) pairs routed to each expert of each sparse layer
        since the model was built or :meth:`reset_expert_load` (each row sums to tokens × top_k). Empty for a
        dense model."""
        counts = [moe.tokens_per_expert.cpu() for moe in self.moe_blocks()]
        return torch.stack(counts) if counts else torch.zeros(0, 0, dtype=torch.long)

    def reset_expert_load(self) -> None:
        for moe in self.moe_blocks():
            moe.reset_load()

    def moe_blocks(self) -> list[nn.Module]:
        """The sparse layers' mixtures of experts (a :class:`SparseMoE`, or a parallel one swapped in for it)."""
        return [layer.mlp for layer in self.layers if hasattr(layer.mlp, "tokens_per_expert")]

    @property
    def backend(self) -> TorchBackend:
        return self.layers[0].input_layernorm.backend  # every pipeline stage has layers, not every one the norm

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this process holds and caches: the config's, or a tensor-parallel rank's share."""
        return self.layers[0].self_attn.num_kv_heads

    def set_kv_caches(self, kv_caches: list[torch.Tensor] | None, kv_scales: list[torch.Tensor] | None = None) -> None:
        """Hand each layer its slice of the paged KV cache (or take the caches away with None), and with an
        8-bit cache each layer's ``[2, num_kv_heads]`` scales."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_cache = None if kv_caches is None else kv_caches[i]
            layer.self_attn.kv_scales = None if kv_caches is None or kv_scales is None else kv_scales[i]

    @torch.inference_mode()
    def logits_without_cache(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position of one sequence ``[seq_len]`` → ``[seq_len, vocab]``, nothing cached.

        The plain forward the parity tests and perplexity use; the engine never calls it.
        """
        previous = [layer.self_attn.kv_cache for layer in self.layers]
        scales = [layer.self_attn.kv_scales for layer in self.layers]
        self.set_kv_caches(None)
        try:
            positions = torch.arange(len(token_ids), device=token_ids.device)
            meta = AttentionMetadata.without_cache([len(token_ids)])
            return self.compute_logits(self(token_ids, positions, meta))
        finally:
            self.set_kv_caches(previous, None if scales[0] is None else scales)

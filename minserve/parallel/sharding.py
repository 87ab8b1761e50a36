"""Tensor parallelism by swapping layers: each rank keeps a slice of every weight, and a collective where
the slices meet. The model file does not change (as in gpt-fast); only its linear layers are replaced by
smaller ones, and two kinds of them get a hook that runs the collective on their output.

Megatron-LM's pairing makes one collective per block enough. In a decoder layer:

* **column-parallel** ``qkv_proj`` and ``gate_up_proj``: a rank keeps the output rows of its own heads (its
  ``num_heads / n`` query heads and ``num_kv_heads / n`` KV heads) and its ``1 / n`` of the MLP's gate and up
  rows. Its output is a slice of the full output, and attention and SwiGLU work on slices as they are: a
  head needs no other head, and ``silu(gate) · up`` is elementwise.
* **row-parallel** ``o_proj`` and ``down_proj``: a rank keeps the input columns that match the slice it
  holds, so its product is a *partial sum* of the full output; one all-reduce adds the ranks' partial sums.
  The bias, if any, is added once, by rank 0.

So a layer all-reduces twice, ``[tokens, hidden]`` each time. The embedding and the head are split along
the vocabulary: a rank looks up only the tokens in its range (the others give zeros; an all-reduce sums
them), and the head's logits are all-gathered, a ``1 / n`` slice of the vocabulary from each rank. The KV
cache is split with the heads: each rank stores its own KV heads, so the same memory per rank holds ``n``
times the tokens.

A mixture-of-experts layer is split one of two ways. By default each expert is split like the MLP (its
``1 / n`` of every expert's gate, up and down), and one all-reduce adds the layer's partial sums; the router
stays whole on every rank, so every rank routes every token alike. With ``expert_parallel`` each rank keeps
whole experts instead, ``num_experts / n`` of them, and tokens travel to them (:mod:`.expert_parallel`).

The collectives ride on forward hooks, which a module swapped in later (a quantized linear) takes over
(:func:`minserve.quant.swap.quantize_model` keeps them), so quantization and tensor parallelism compose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minserve.model.config import ModelConfig
from minserve.model.llama import SparseMoE
from minserve.parallel.comm import Communicator
from minserve.parallel.expert_parallel import ExpertParallelMoE


def check_tensor_parallel(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ``ValueError`` naming the sizes that work unless ``size`` ranks can split ``config``'s heads, KV
    heads, MLP and experts evenly (with ``expert_parallel``, the experts themselves, else each expert's width);
    expert parallelism of a model without experts is refused."""
    if expert_parallel and not config.moe_layers:
        raise ValueError(
            f"enable_expert_parallel splits a mixture-of-experts model's experts across ranks, and this "
            f"{config.family} model is dense (no experts): drop enable_expert_parallel"
        )
    parts = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads}
    if config.dense_layers:
        parts["MLP width"] = config.intermediate_size
    if config.moe_layers and expert_parallel:
        parts["experts"] = config.num_experts
    elif config.moe_layers:
        parts["expert width"] = config.moe_intermediate_size
    if size < 1 or any(count % size for count in parts.values()):
        working = [n for n in range(1, config.num_kv_heads + 1) if all(c % n == 0 for c in parts.values())]
        counts = ", ".join(f"{count} {name}" for name, count in parts.items())
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {counts}; sizes that work: "
            + ", ".join(map(str, working))
        )


def shard_model(model: nn.Module, comm: Communicator, expert_parallel: bool = False) -> nn.Module:
    """Keep rank ``comm.rank``'s slice of every layer of ``model``, in place (see the module docstring); with
    ``expert_parallel``, its whole experts of each mixture-of-experts layer."""
    check_tensor_parallel(model.config, comm.world_size, expert_parallel)
    for layer in model.layers:
        _shard_attention(layer.self_attn, comm)
        if isinstance(layer.mlp, SparseMoE) and expert_parallel:
            layer.mlp = ExpertParallelMoE(layer.mlp, comm)
        elif isinstance(layer.mlp, SparseMoE):
            _shard_experts(layer.mlp, comm)
        else:
            _shard_mlp(layer.mlp, comm)
    vocab = model.config.vocab_size
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, comm)
    head_weight = model.embed_tokens.weight if tied else _vocab_slice(model.lm_head.weight, comm)
    model.lm_head = _linear(head_weight, None)
    model.lm_head.register_forward_hook(lambda _module, _inputs, out: comm.all_gather(out, -1)[..., :vocab])
    return model


def _shard_attention(attn: nn.Module, comm: Communicator) -> None:
    n, r, d = comm.world_size, comm.rank, attn.head_dim
    heads, kv_heads = attn.num_heads // n, attn.num_kv_heads // n
    q_rows = torch.arange(r * heads * d, (r + 1) * heads * d)
    kv_rows = torch.arange(r * kv_heads * d, (r + 1) * kv_heads * d)
    rows = torch.cat([q_rows, attn.q_size + kv_rows, attn.q_size + attn.kv_size + kv_rows])
    attn.qkv_proj = _rows_of(attn.qkv_proj, rows)
    attn.o_proj = _row_parallel(attn.o_proj, q_rows, comm)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d


def _shard_mlp(mlp: nn.Module, comm: Communicator, all_reduce: bool = True) -> None:
    width = mlp.intermediate_size // comm.world_size
    mine = torch.arange(comm.rank * width, (comm.rank + 1) * width)
    mlp.gate_up_proj = _rows_of(mlp.gate_up_proj, torch.cat([mine, mlp.intermediate_size + mine]))
    mlp.down_proj = _row_parallel(mlp.down_proj, mine, comm, all_reduce)
    mlp.intermediate_size = width


def _shard_experts(moe: SparseMoE, comm: Communicator) -> None:
    """Every expert split like the MLP; the layer's output is a weighted sum of partial sums, so one
    all-reduce of it (not one per expert) completes them all."""
    for expert in moe.experts:
        _shard_mlp(expert, comm, all_reduce=False)
    moe.register_forward_hook(lambda _module, _inputs, out: comm.all_reduce(out))


def _rows_of(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """Column parallel: the output features ``rows`` of ``linear``."""
    bias = None if linear.bias is None else linear.bias[rows]
    return _linear(linear.weight[rows], bias)


def _row_parallel(linear: nn.Linear, columns: torch.Tensor, comm: Communicator, all_reduce: bool = True) -> nn.Linear:
    """Row parallel: the input features ``columns`` of ``linear``; its output all-reduced (unless the caller
    reduces a later sum), the bias added once."""
    bias = linear.bias if linear.bias is not None and comm.rank == 0 else None
    sliced = _linear(linear.weight[:, columns], bias)
    if all_reduce:
        sliced.register_forward_hook(lambda _module, _inputs, out: comm.all_reduce(out))
    return sliced


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` (``[out, in]``) and ``bias``: quantization finds it as it
    finds any other, and the full weight it was cut from can be freed."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach().clone(), False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return linear


def _vocab_slice(weight: torch.Tensor, comm: Communicator) -> nn.Parameter:
    """Rank ``comm.rank``'s ``ceil(vocab / n)`` rows of an ``[vocab, hidden]`` weight, the last padded with
    zero rows so every rank's slice (and so every all-gathered piece) has one shape."""
    per_rank = -(-weight.shape[0] // comm.world_size)
    rows = weight[comm.rank * per_rank : (comm.rank + 1) * per_rank].detach()
    padded = torch.zeros(per_rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
    padded[: len(rows)] = rows
    return nn.Parameter(padded, requires_grad=False)


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the token embedding, ``[ceil(vocab / n), hidden]``: tokens outside its range look up
    zeros, and an all-reduce sums the ranks' lookups into every token's row."""

    def __init__(self, weight: torch.Tensor, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.weight = _vocab_slice(weight, comm)
        self.first_token = comm.rank * self.weight.shape[0]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.first_token
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.comm.all_reduce(rows)

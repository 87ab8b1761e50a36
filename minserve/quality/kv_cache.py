"""A sequence's logits when its keys and values are read back from a quantized KV cache, as a served request's are.

Chapter 07 compares KV-cache formats by what they do to the model's next-token distribution; this is the
measuring side of that comparison (:mod:`minserve.model.kv_quant` holds the codes and scales themselves).
"""

from __future__ import annotations

import torch
from torch import nn

from minserve.model.attention import AttentionMetadata, allocate_kv_cache


@torch.inference_mode()
def logits_through_cache(
    model: nn.Module, token_ids: torch.Tensor, cache_dtype: torch.dtype, kv_scales: list[torch.Tensor]
) -> torch.Tensor:
    """``[seq_len, vocab]`` logits of one sequence run as a prefill through a scratch cache of ``cache_dtype``
    of its own: every position attends to keys and values read back from their codes, as a served request's
    do. (The engine's cache is not touched; the model's own is put back after.)"""
    config, n, device = model.config, len(token_ids), token_ids.device
    block_size = 16
    num_blocks = -(-n // block_size)
    scratch = allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                                cache_dtype, device)  # fmt: skip
    previous = [(layer.self_attn.kv_cache, layer.self_attn.kv_scales) for layer in model.layers]
    model.set_kv_caches(scratch, kv_scales)
    try:
        meta = AttentionMetadata(
            query_lens=[n],
            context_lens=[n],
            slot_mapping=torch.arange(n, device=device),
            block_tables=torch.arange(num_blocks, device=device)[None, :],
        )
        return model.compute_logits(model(token_ids, torch.arange(n, device=device), meta))
    finally:
        for layer, (cache, scales) in zip(model.layers, previous):
            layer.self_attn.kv_cache, layer.self_attn.kv_scales = cache, scales

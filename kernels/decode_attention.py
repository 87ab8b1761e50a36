"""Paged decode attention: one new query per sequence, attending over its whole context through its block
table, split along the context (flash-decoding) so long contexts use the whole GPU.

A decode step has one query token per sequence, so there is little parallel work per sequence, and a long
context makes one program walk thousands of keys alone. Flash-decoding splits each sequence's keys into
``num_splits`` ranges: every (sequence, KV head, split) program computes a partial softmax over its range,
keeping its running maximum ``m``, sum ``l`` and weighted values ``acc`` (the online softmax); a second
kernel merges the splits of each sequence exactly:

    m = max_s m_s,   l = Σ_s l_s · e^(m_s − m),   out = Σ_s acc_s · e^(m_s − m) / l

Grouped-query attention: the ``num_heads / num_kv_heads`` query heads that share a KV head are handled by
one program, so each key and value is read from memory once per group, not once per query head. Keys are
found token by token through the block table, so any block size works.

The cache may be 8-bit (int8 or float8 e4m3 codes, see :mod:`minserve.kernels.kv_store`), with
``kv_scales`` ``[2, num_kv_heads]`` float32. Since a program handles one KV head, its key and value scales
are two numbers, loaded once; each tile of codes is read from memory as it is, one byte per element, and
widened in registers (to float32, times the scale). Decode attention is bound by the bytes of KV it reads,
so reading codes instead of widened copies is the point, not only the memory an 8-bit cache saves.

    query [batch, num_heads, head_dim]; kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables [batch, max_blocks] (int); context_lens [batch] (int); kv_scales [2, num_kv_heads] or None
    →  out [batch, num_heads, head_dim]
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, checked_kv_scales, compare, gather_context

BLOCK_N = 32  # keys per inner iteration
NO_WINDOW = 2**30  # "no sliding window": a window longer than any context


@triton.jit
def _decode_partial_kernel(
    q_ptr, cache_ptr, key_scales_ptr, value_scales_ptr, tables_ptr, context_lens_ptr, acc_ptr, m_ptr, l_ptr,
    scale, window, num_heads, group, block_size, values_offset, tables_stride, keys_per_split,
    cache_block_stride, cache_token_stride, cache_head_stride,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    KV_8BIT: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    heads = kv_head * group + tl.arange(0, BLOCK_G)  # the query heads sharing this KV head
    head_mask = tl.arange(0, BLOCK_G) < group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :], mask=head_mask[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    if KV_8BIT:  # this KV head's two scales, for every code the program reads
        key_scale = tl.load(key_scales_ptr + kv_head)
        value_scale = tl.load(value_scales_ptr + kv_head)

    first_key = tl.maximum(context_len - window, 0)  # the sliding window's oldest key (window: huge if none)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, context_len)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    for block_start in range(start, end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        key_mask = (keys < end) & (keys >= first_key)
        physical = tl.load(tables_ptr + seq * tables_stride + keys // block_size, mask=keys < end, other=0)
        rows = physical * cache_block_stride + (keys % block_size) * cache_token_stride + kv_head * cache_head_stride
        k = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + values_offset + rows[:, None] + dims[None, :], mask=key_mask[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
        if KV_8BIT:
            k, v = k * key_scale, v * value_scale
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp() away from inf − inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    partial = (seq * num_heads + heads) * NUM_SPLITS + split
    tl.store(m_ptr + partial, m_i, mask=head_mask)
    tl.store(l_ptr + partial, l_i, mask=head_mask)
    tl.store(acc_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_mask[:, None])


@triton.jit
def _decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    row = tl.program_id(0)  # one (sequence, query head)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(m_ptr + row * NUM_SPLITS + splits)
    l_s = tl.load(l_ptr + row * NUM_SPLITS + splits)
    m_max = tl.max(m, axis=0)
    weights = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # an empty split weighs nothing
    acc = tl.load(acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(l_s * weights, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def num_splits_for(max_context_len: int, batch: int, target_programs: int = 256) -> int:
    """How many splits: enough programs to fill a GPU when the batch is small, none when it is already big."""
    if max_context_len <= 4 * BLOCK_N:
        return 1
    wanted = max(1, target_programs // max(batch, 1))
    return min(triton.next_power_of_2(wanted), triton.next_power_of_2(math.ceil(max_context_len / BLOCK_N)), 64)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its cached context (see the module docstring).

    ``max_context_len`` (any upper bound of ``context_lens``) spares reading it back from the GPU, which a
    CUDA graph cannot do while it is being captured. ``kv_scales`` ``[2, num_kv_heads]`` float32: an 8-bit
    cache's per-head scales (required with one, refused without).
    """
    check_device(query, kv_cache, block_tables, context_lens)
    scales = checked_kv_scales(kv_cache, kv_scales)
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if head_dim & (head_dim - 1):
        raise ValueError(f"decode_attention: head_dim must be a power of two, got {head_dim}")
    out = torch.empty_like(query)
    if batch == 0:
        return out
    max_context = int(context_lens.max()) if max_context_len is None else max_context_len
    splits = num_splits or num_splits_for(max_context, batch)
    if splits & (splits - 1):
        raise ValueError(f"decode_attention: num_splits must be a power of two, got {splits}")
    keys_per_split = triton.cdiv(triton.cdiv(max_context, splits), BLOCK_N) * BLOCK_N
    partial_shape = (batch, num_heads, splits)
    acc = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=query.device)
    m = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    l_sum = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    group = num_heads // num_kv_heads
    key_scales, value_scales = (None, None) if scales is None else scales.unbind(0)
    _decode_partial_kernel[(batch, num_kv_heads, splits)](
        query.contiguous(), kv_cache, key_scales, value_scales, block_tables, context_lens, acc, m, l_sum,
        scale, sliding_window or NO_WINDOW, num_heads, group, block_size, kv_cache[0].numel(), block_tables.stride(0),
        keys_per_split, kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=head_dim, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=BLOCK_N, NUM_SPLITS=splits,
        KV_8BIT=scales is not None,
    )  # fmt: skip
    _decode_reduce_kernel[(batch * num_heads,)](acc, m, l_sum, out, HEAD_DIM=head_dim, NUM_SPLITS=splits)
    return out


def reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's keys through its block table (an 8-bit cache's widened with ``kv_scales``) and
    run SDPA, one sequence at a time."""
    outs = []
    for i, context_len in enumerate(context_lens.tolist()):
        blocks = gather_context(kv_cache, block_tables[i], context_len, kv_scales)
        keys, values = blocks[0].transpose(0, 1), blocks[1].transpose(0, 1)  # [kv_heads, context, head_dim]
        mask = torch.ones(context_len, dtype=torch.bool, device=query.device)
        if sliding_window:
            mask[: max(context_len - sliding_window, 0)] = False
        out = torch.nn.functional.scaled_dot_product_attention(
            query[i][:, None, :].float(), keys.float(), values.float(), attn_mask=mask[None, None, :], scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        outs.append(out[:, 0, :].to(query.dtype))
    return torch.stack(outs)


def benchmark(
    batch: int = 64,
    context: int = 4096,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """The kernel against gather-then-SDPA on the GPU: milliseconds, and GB/s of KV read (the bound)."""
    blocks_per_seq = context // block_size
    cache = torch.randn(2, batch * blocks_per_seq, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim**-0.5

    def gathered_sdpa() -> torch.Tensor:
        kv = cache[:, tables].flatten(2, 3)  # [2, batch, context, kv_heads, head_dim]: the torch backend's copy
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], kv[0].transpose(1, 2), kv[1].transpose(1, 2), scale=scale, enable_gqa=True
        )

    kv_bytes = cache.numel() * cache.element_size()
    return compare(lambda: decode_attention(q, cache, tables, lens, scale), gathered_sdpa, kv_bytes, "gbps")

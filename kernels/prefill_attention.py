"""Prefill attention over a paged KV cache: causal, a variable-length batch, the cached prefix included.

A prefill step runs many new tokens of several sequences, laid end to end in one flat tensor. Sequence
``i`` brings ``query_lens[i]`` new tokens whose keys and values are already stored in the cache, behind
``context_lens[i] − query_lens[i]`` tokens it had before: a prefix found in the prefix cache, or the chunks
of a long prompt that earlier steps prefilled. So every key is read through the block table, and a cached
prefix, a chunked prefill and a fresh prompt are one case.

One program takes ``BLOCK_M`` queries of one sequence and one head, and walks that sequence's keys in
tiles of ``BLOCK_N`` with the online softmax of FlashAttention, stopping at the last key the causal mask
lets its last query see. Query ``j`` of the sequence sits at position ``context_len − query_len + j``, and
sees the keys at positions ``≤`` its own (and, with a sliding window, ``>`` its own − window).

The cache may be 8-bit (int8 or float8 e4m3 codes, see :mod:`minserve.kernels.kv_store`), with
``kv_scales`` ``[2, num_kv_heads]`` float32. A program's head reads one KV head, so its key and value scales
are two numbers, loaded once; every tile of codes is read as it is, one byte per element, and widened in
registers (to float32, times the scale, then to the query's dtype for the matmuls, as the torch path
widens the gathered codes).

    query [num_tokens, num_heads, head_dim]; query_starts [batch + 1]; query_lens, context_lens [batch]
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]; block_tables [batch, max_blocks]
    kv_scales [2, num_kv_heads] or None  →  out [num_tokens, num_heads, head_dim]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, checked_kv_scales, compare, gather_context, interpreting

NO_WINDOW = 2**30  # "no sliding window": a window longer than any context


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, key_scales_ptr, value_scales_ptr, tables_ptr, query_starts_ptr, query_lens_ptr,
    context_lens_ptr, out_ptr, scale, window, num_heads, group, block_size, values_offset, tables_stride,
    cache_block_stride, cache_token_stride, cache_head_stride,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_8BIT: tl.constexpr,
):  # fmt: skip
    seq, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq)
    if m_block * BLOCK_M < query_len:
        query_start = tl.load(query_starts_ptr + seq)
        context_len = tl.load(context_lens_ptr + seq)
        kv_head = head // group
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < query_len
        query_pos = context_len - query_len + rows
        dims = tl.arange(0, HEAD_DIM)
        q_offsets = ((query_start + rows[:, None]) * num_heads + head) * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None], other=0.0)
        if DOT_FP32:  # the interpreter's 16-bit dot is not to be trusted; on a GPU the tensor cores take 16-bit
            q = q.to(tl.float32)
        if KV_8BIT:  # this KV head's two scales, for every code the program reads
            key_scale = tl.load(key_scales_ptr + kv_head)
            value_scale = tl.load(value_scales_ptr + kv_head)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        last_query_pos = context_len - query_len + tl.minimum((m_block + 1) * BLOCK_M, query_len) - 1
        first_key = tl.maximum(context_len - query_len + m_block * BLOCK_M - window + 1, 0)
        first_tile = (first_key // BLOCK_N) * BLOCK_N
        for tile in range(first_tile, last_query_pos + 1, BLOCK_N):
            keys = tile + tl.arange(0, BLOCK_N)
            key_in = keys < context_len
            physical = tl.load(tables_ptr + seq * tables_stride + keys // block_size, mask=key_in, other=0)
            key_rows = physical * cache_block_stride + (keys % block_size) * cache_token_stride
            key_rows += kv_head * cache_head_stride
            k = tl.load(cache_ptr + key_rows[None, :] + dims[:, None], mask=key_in[None, :], other=0.0)  # [D, N]
            v = tl.load(cache_ptr + values_offset + key_rows[:, None] + dims[None, :], mask=key_in[:, None], other=0.0)
            if KV_8BIT:
                k, v = k.to(tl.float32) * key_scale, v.to(tl.float32) * value_scale
            scores = tl.dot(q, k.to(q.dtype)).to(tl.float32) * scale  # [M, N]
            visible = (keys[None, :] <= query_pos[:, None]) & (keys[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible & key_in[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype)).to(tl.float32)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context (module docstring);
    ``kv_scales`` ``[2, num_kv_heads]`` float32: an 8-bit cache's per-head scales (required with one)."""
    check_device(query, kv_cache, block_tables, query_starts, query_lens, context_lens)
    scales = checked_kv_scales(kv_cache, kv_scales)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"prefill_attention: head_dim must be a power of two ≥ 16, got {head_dim}")
    out = torch.empty_like(query)
    batch = query_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_m, block_n = (64, 64) if query.is_cuda else (16, 16)  # small tiles keep the interpreter quick
    grid = (batch, num_heads, triton.cdiv(max_query_len, block_m))
    key_scales, value_scales = (None, None) if scales is None else scales.unbind(0)
    _prefill_kernel[grid](
        query.contiguous(), kv_cache, key_scales, value_scales, block_tables, query_starts, query_lens, context_lens,
        out, scale, sliding_window or NO_WINDOW, num_heads, num_heads // num_kv_heads, block_size,
        kv_cache[0].numel(), block_tables.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=interpreting(), KV_8BIT=scales is not None,
    )  # fmt: skip
    return out


def reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's keys through its block table (an 8-bit cache's widened with ``kv_scales``) and
    run masked SDPA, one sequence at a time."""
    out = torch.empty_like(query)
    for i, (start, n, context_len) in enumerate(zip(query_starts.tolist(), query_lens.tolist(), context_lens.tolist())):
        blocks = gather_context(kv_cache, block_tables[i], context_len, kv_scales)
        query_pos = torch.arange(context_len - n, context_len, device=query.device)[:, None]
        key_pos = torch.arange(context_len, device=query.device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window:
            mask &= key_pos > query_pos - sliding_window
        attended = torch.nn.functional.scaled_dot_product_attention(
            query[start : start + n].transpose(0, 1).float(), blocks[0].transpose(0, 1).float(),
            blocks[1].transpose(0, 1).float(), attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        out[start : start + n] = attended.transpose(0, 1).to(query.dtype)
    return out


def benchmark(
    batch: int = 8,
    prompt: int = 2048,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """The kernel (keys read through the block table) against SDPA on contiguous keys: ms and TFLOP/s."""
    blocks_per_seq = prompt // block_size
    cache = torch.randn(2, batch * blocks_per_seq, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    tables = torch.arange(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq)
    q = torch.randn(batch * prompt, num_heads, head_dim, device="cuda", dtype=dtype)
    lens = torch.full((batch,), prompt, device="cuda", dtype=torch.int32)
    starts = torch.arange(0, (batch + 1) * prompt, prompt, device="cuda", dtype=torch.int32)
    scale = head_dim**-0.5
    contiguous = cache.view(2, batch, prompt, num_kv_heads, head_dim).transpose(2, 3)  # [2, B, KVH, T, D]
    q_sdpa = q.view(batch, prompt, num_heads, head_dim).transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_sdpa, contiguous[0], contiguous[1], is_causal=True, scale=scale, enable_gqa=True
        )

    flops = 4 * batch * num_heads * head_dim * prompt * prompt / 2  # QKᵀ and PV, half masked away
    return compare(
        lambda: prefill_attention(q, cache, tables, starts, lens, lens, prompt, scale), sdpa, flops, "tflops"
    )

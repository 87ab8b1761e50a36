"""The torch backend's attention over a paged cache against attention written out per sequence.

The reference gathers nothing: it keeps each sequence's keys and values in one dense tensor and computes the
softmax in float64. The paged side stores the same keys in scattered blocks and must give the same output
whatever the step looks like: decode rows sliced into several gathers (rows sorted by length and put back),
16-bit tensors taking the grouped-matmul path, a sliding window, prefill and decode rows in one step.
"""

from __future__ import annotations

import pytest
import torch

import minserve.model.attention as attention
from minserve.model.attention import AttentionMetadata, decode_attention, paged_attention
from minserve.model.kv_quant import quantize_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 8, 4
SCALE = HEAD_DIM**-0.5


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """Queries at the last ``len(query)`` positions of ``keys``; float64, heads repeated for their group."""
    num_queries, context = query.shape[0], keys.shape[0]
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)  # [context, heads, dim]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * SCALE
    query_pos = torch.arange(context - num_queries, context)[:, None]
    key_pos = torch.arange(context)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= query_pos - key_pos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_step(context_lens: list[int], query_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """A cache holding every sequence's earlier tokens in shuffled blocks, and this step's new tokens.

    Returns (query, new keys, new values, cache, metadata, each sequence's full keys and values)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int64)
    full_keys, full_values, slots, new_k, new_v = [], [], [], [], []
    for i, (context, new) in enumerate(zip(context_lens, query_lens, strict=True)):
        ids = [order.pop() for _ in range(blocks_per_seq[i])]
        tables[i, : len(ids)] = torch.tensor(ids)
        keys = torch.randn(context, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        values = torch.randn(context, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        full_keys.append(keys)
        full_values.append(values)
        seq_slots = [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context)]
        old = context - new
        cache[0].flatten(0, 1)[seq_slots[:old]] = keys[:old]  # the cached prefix; this step stores the rest
        cache[1].flatten(0, 1)[seq_slots[:old]] = values[:old]
        slots += seq_slots[old:]
        new_k.append(keys[old:])
        new_v.append(values[old:])
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(list(query_lens), list(context_lens), torch.tensor(slots), tables)
    return query, torch.cat(new_k), torch.cat(new_v), cache, meta, full_keys, full_values


def expected(query, meta, full_keys, full_values, window):
    outputs, start = [], 0
    for n, keys, values in zip(meta.query_lens, full_keys, full_values, strict=True):
        outputs.append(reference(query[start : start + n], keys, values, window))
        start += n
    return torch.cat(outputs)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("slice_blocks", [1, 7, None])  # a slice: one sequence; a few; the whole batch
def test_decode_rows_match_dense_attention(monkeypatch, dtype, window, slice_blocks):
    context_lens = [9, 1, 23, 4, 17, 12, 30]  # not sorted: slices are formed by length and put back in order
    query, k, v, cache, meta, keys, values = paged_step(context_lens, [1] * len(context_lens), dtype)
    block_bytes = cache[:, 0].numel() * cache.element_size()
    if slice_blocks is not None:
        monkeypatch.setattr(attention, "DECODE_SLICE_BYTES", slice_blocks * block_bytes)
    out = paged_attention(query, k, v, cache, meta, SCALE, window)
    want = expected(query, meta, keys, values, window)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_rows_in_one_step(monkeypatch, dtype):
    monkeypatch.setattr(attention, "DECODE_SLICE_BYTES", 1)  # every decode row its own slice
    context_lens, query_lens = [14, 5, 9, 6], [1, 5, 1, 3]  # decode, whole prompt, decode, a chunk
    query, k, v, cache, meta, keys, values = paged_step(context_lens, query_lens, dtype, seed=1)
    out = paged_attention(query, k, v, cache, meta, SCALE)
    torch.testing.assert_close(out.double(), expected(query, meta, keys, values, None),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_steps_decode_attention_matches(dtype):
    """The tensor-only decode path that compiled steps run: whole batch, every block of the table read."""
    context_lens = [3, 18, 11]
    query, k, v, cache, meta, keys, values = paged_step(context_lens, [1, 1, 1], dtype, seed=2)
    out = decode_attention(query, k, v, cache, meta.slot_mapping, meta.block_tables,
                           torch.tensor(context_lens), SCALE)  # fmt: skip
    torch.testing.assert_close(out.double(), expected(query, meta, keys, values, None),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])  # fmt: skip


@pytest.mark.parametrize("window", [None, 5])
def test_compiled_steps_decode_attention_reads_an_8bit_cache_as_the_eager_path_does(window):
    """The tensor-only path with int8 keys and values (widened in its sums) and a sliding window: the eager
    path's output from the same codes and scales."""
    context_lens = [3, 18, 11]
    query, k, v, cache, meta, _, _ = paged_step(context_lens, [1, 1, 1], torch.float32, seed=3)
    scales = cache.abs().amax(dim=(1, 2, 4)) / 127  # [2, kv_heads]
    codes = torch.stack([quantize_kv(cache[i].flatten(0, 1), scales[i], torch.int8) for i in (0, 1)])
    codes = codes.view(cache.shape)
    eager = paged_attention(query, k, v, codes.clone(), meta, SCALE, window, kv_scales=scales)
    compiled_path = decode_attention(query, k, v, codes.clone(), meta.slot_mapping, meta.block_tables,
                                     torch.tensor(context_lens), SCALE, window, kv_scales=scales)  # fmt: skip
    torch.testing.assert_close(compiled_path, eager, atol=1e-5, rtol=1e-5)

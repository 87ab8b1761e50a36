"""KV-cache store: write this step's new keys and values into their slots of the paged cache.

The scheduler gave every new token a slot, ``block · block_size + offset`` (``slot_mapping``); the cache of
one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. One program copies one token's keys
and values (all its KV heads) to its slot. A slot of −1 means "do not store" (a padding token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, compare


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, values_offset, row_size, token_stride,
                     BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < row_size
        key = tl.load(key_ptr + token * token_stride + cols, mask=mask)
        value = tl.load(value_ptr + token * token_stride + cols, mask=mask)
        tl.store(cache_ptr + slot * row_size + cols, key, mask=mask)
        tl.store(cache_ptr + values_offset + slot * row_size + cols, value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping``."""
    check_device(key, value, kv_cache, slot_mapping)
    if not kv_cache.is_contiguous():
        raise ValueError("store_kv: the KV cache must be contiguous")
    key, value = key.contiguous(), value.contiguous()
    num_tokens, row_size = key.shape[0], key.shape[1] * key.shape[2]
    if num_tokens == 0:
        return
    values_offset = kv_cache[0].numel()
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, values_offset, row_size, key.stride(0),
        BLOCK=triton.next_power_of_2(row_size),
    )  # fmt: skip


def reference(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The torch computation the kernel replaces (``index_copy_`` into flattened views)."""
    keep = slot_mapping >= 0
    kv_cache[0].flatten(0, 1).index_copy_(0, slot_mapping[keep], key[keep])
    kv_cache[1].flatten(0, 1).index_copy_(0, slot_mapping[keep], value[keep])


def benchmark(
    num_tokens: int = 4096,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """The kernel against torch's ``index_copy_`` on the GPU: milliseconds and achieved GB/s."""
    num_blocks = 2 * num_tokens // block_size
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    moved_bytes = 4 * key.numel() * key.element_size()  # read k and v, write them
    return compare(
        lambda: store_kv(key, value, cache, slots), lambda: reference(key, value, cache, slots), moved_bytes, "gbps"
    )

"""KV-cache store: write this step's new keys and values into their slots of the paged cache.

The scheduler gave every new token a slot, ``block · block_size + offset`` (``slot_mapping``); the cache of
one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. One program copies one token's keys
and values (all its KV heads) to its slot. A slot of −1 means "do not store" (a padding token).

An 8-bit cache (int8 or float8 e4m3 codes) comes with ``kv_scales`` ``[2, num_kv_heads]`` float32, one scale
per KV head for keys (row 0) and values (row 1): the program divides each head's values by its scale,
clips them to the codes' range (±127, ±448) and rounds them to the nearest code, ties to even, as torch's
``round`` and its float8 conversion do, so the codes are the torch reference's, bit for bit:

* int8: ``.to(tl.int8)`` truncates toward zero (2.7 → 2), so the value is rounded first
  (:func:`_round_half_to_even`);
* e4m3: a GPU's conversion rounds to nearest even, but the interpreter (``TRITON_INTERPRET=1``, as of
  Triton 3.9) loses the carry when it rounds a mantissa up (7.75 becomes 4, not 8) and rounds ties away
  from zero; so the value is rounded onto the e4m3 grid in float32 first (:func:`_round_to_e4m3`), and the
  conversion that follows is exact on either.

The division is ``div_rn``, correctly rounded as torch's: Triton's ``/`` on a GPU is an approximation that
can move a value across a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.kernels._common import CODE_MAX, check_device, checked_kv_scales, compare


@triton.jit
def _round_half_to_even(magnitude):
    """float32 ``magnitude`` (≥ 0) rounded to the nearest integer, a tie to the even one (torch.round's rule)."""
    below = tl.floor(magnitude)
    fraction = magnitude - below  # exact: ``below`` is 0, or within a factor of two of ``magnitude``
    odd = (below.to(tl.int32) & 1) == 1
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), below + 1.0, below)


@triton.jit
def _round_to_e4m3(magnitude):
    """float32 ``magnitude`` (0 to 448) rounded, a tie to even, to the nearest float8 e4m3 value, in float32.

    e4m3 keeps 3 bits after the leading one, so between 2^e and 2^(e+1) its values are 2^(e−3) apart; below
    2^−6 (its smallest normal) they are 2^−9 apart. The magnitude is rounded to a multiple of that step."""
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # magnitude = 1.m · 2^exponent
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent − 3)
    return _round_half_to_even(tl.math.div_rn(magnitude, step)) * step  # exact: step is a power of two


@triton.jit
def _to_codes(x, scale, CODE_MAX: tl.constexpr, INTEGER_CODES: tl.constexpr):
    """Values ``x`` over their head's ``scale``, clipped to ±``CODE_MAX`` and rounded to a code's value
    (float32; converting it to the cache's dtype is then exact)."""
    scaled = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -CODE_MAX, CODE_MAX)
    magnitude = tl.abs(scaled)  # rounding to nearest is symmetric: round the magnitude, put the sign back
    rounded = _round_half_to_even(magnitude) if INTEGER_CODES else _round_to_e4m3(magnitude)  # at compile time
    return tl.where(scaled.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: −0.0 stays −0.0


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, key_scales_ptr, value_scales_ptr, values_offset,
                     row_size, token_stride, head_dim,
                     BLOCK: tl.constexpr, KV_8BIT: tl.constexpr, CODE_MAX: tl.constexpr,
                     INTEGER_CODES: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < row_size
        key = tl.load(key_ptr + token * token_stride + cols, mask=mask)
        value = tl.load(value_ptr + token * token_stride + cols, mask=mask)
        if KV_8BIT:
            heads = cols // head_dim  # the row is every KV head's head_dim values, end to end
            key_scale = tl.load(key_scales_ptr + heads, mask=mask, other=1.0)
            value_scale = tl.load(value_scales_ptr + heads, mask=mask, other=1.0)
            key = _to_codes(key, key_scale, CODE_MAX, INTEGER_CODES)
            value = _to_codes(value, value_scale, CODE_MAX, INTEGER_CODES)
        code_type = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + slot * row_size + cols, key.to(code_type), mask=mask)
        tl.store(cache_ptr + values_offset + slot * row_size + cols, value.to(code_type), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Copy ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping``;
    into an 8-bit cache as codes under ``kv_scales`` ``[2, num_kv_heads]`` float32 (module docstring)."""
    check_device(key, value, kv_cache, slot_mapping)
    if not kv_cache.is_contiguous():
        raise ValueError("store_kv: the KV cache must be contiguous")
    scales = checked_kv_scales(kv_cache, kv_scales)
    key, value = key.contiguous(), value.contiguous()
    num_tokens, row_size = key.shape[0], key.shape[1] * key.shape[2]
    if num_tokens == 0:
        return
    key_scales, value_scales = (None, None) if scales is None else scales.unbind(0)
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, key_scales, value_scales, kv_cache[0].numel(), row_size, key.stride(0),
        key.shape[2], BLOCK=triton.next_power_of_2(row_size), KV_8BIT=scales is not None,
        CODE_MAX=CODE_MAX.get(kv_cache.dtype, 0.0), INTEGER_CODES=kv_cache.dtype == torch.int8,
    )  # fmt: skip


def reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """The torch computation the kernel replaces (``index_copy_`` into flattened views), codes included."""
    keep = slot_mapping >= 0
    slots, key, value = slot_mapping[keep], key[keep], value[keep]
    if kv_scales is not None:
        key, value = (reference_codes(x, scales, kv_cache.dtype) for x, scales in zip((key, value), kv_scales))
        kv_cache, key, value = kv_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    kv_cache[0].flatten(0, 1).index_copy_(0, slots, key)  # (as bytes for an 8-bit cache: fp8 has no index_copy_)
    kv_cache[1].flatten(0, 1).index_copy_(0, slots, value)


def reference_codes(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, heads, head_dim]`` values → codes of ``dtype``: over ``scales[h]`` ``[heads]``, clipped to
    the codes' range, int8 rounded to nearest (ties to even; ``.to`` alone would truncate)."""
    limit = CODE_MAX[dtype]
    scaled = (x.float() / scales.float()[None, :, None]).clamp(-limit, limit)
    return (scaled.round() if dtype == torch.int8 else scaled).to(dtype)


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

"""Rotary position embedding ("rotate half" layout), applied to queries and keys in place.

Each head vector is split into halves ``(x1, x2)``; pair ``i`` is rotated by the angle
``position · inv_freq[i]``:  ``x1' = x1·cos − x2·sin``,  ``x2' = x2·cos + x1·sin``. The torch path builds
cos and sin tables for the step and allocates rotated copies of q and k; the kernel computes the angles
itself and rotates every head of one token in one program, in place.

    q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim], positions [num_tokens]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, compare


@triton.jit
def _rotate_heads(ptr, token, positions_f32, inv_freq, num_heads, token_stride, head_stride,
                  HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):  # fmt: skip
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    pairs = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    base = ptr + token * token_stride + heads * head_stride + pairs
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    angle = positions_f32 * inv_freq
    cos, sin = tl.cos(angle), tl.sin(angle)
    tl.store(base, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, inv_freq_ptr, num_heads, num_kv_heads,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride,
    HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + tl.arange(0, HALF))[None, :]
    _rotate_heads(q_ptr, token, position, inv_freq, num_heads, q_token_stride, q_head_stride, HALF, BLOCK_Q_HEADS)
    _rotate_heads(k_ptr, token, position, inv_freq, num_kv_heads, k_token_stride, k_head_stride, HALF, BLOCK_K_HEADS)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate ``q`` and ``k`` in place by their tokens' ``positions``; ``inv_freq`` is ``[head_dim / 2]`` fp32.

    The last dimension of q and k must be contiguous (views from a fused qkv projection are fine).
    """
    check_device(q, k, positions, inv_freq)
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rotary: the head dimension of q and k must be contiguous")
    if num_tokens == 0:
        return
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"rotary: head_dim / 2 must be a power of two for this kernel, got {half}")
    _rotary_kernel[(num_tokens,)](
        q, k, positions, inv_freq.float().contiguous(), num_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HALF=half, BLOCK_Q_HEADS=triton.next_power_of_2(num_heads), BLOCK_K_HEADS=triton.next_power_of_2(k.shape[1]),
    )  # fmt: skip


def reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch computation the kernel replaces (rotated copies; the inputs are left alone)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def benchmark(
    num_tokens: int = 4096,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """In-place kernel against the torch reference on the GPU: milliseconds and achieved GB/s."""
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    positions = torch.arange(num_tokens, device="cuda")
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    moved_bytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read and write q and k
    kernel, torch_side = lambda: apply_rotary_(q, k, positions, inv_freq), lambda: reference(q, k, positions, inv_freq)
    return compare(kernel, torch_side, moved_bytes, "gbps")

"""RMSNorm, fused with the residual add that precedes it in every decoder layer.

A pre-norm transformer layer does ``h = x + attention(...)`` and then ``norm(h)``. Unfused, that is a pass
to write ``h``, a pass to read it for the mean of squares, and a pass to normalize. One kernel per row reads
``x`` and the addend once, writes ``h`` (the residual stream the next block needs) and ``norm(h)``.

    y = h / sqrt(mean(h²) + eps) · weight,  with h = x + addend (or just x)

As in the reference implementation, the normalization is computed in float32, the normalized row is cast
back to the input's dtype, and only then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, compare


@triton.jit
def _rms_norm_kernel(
    x_ptr, addend_ptr, weight_ptr, out_ptr, residual_ptr, hidden, eps,
    HAS_ADDEND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offsets = row * hidden + cols
    dtype = x_ptr.dtype.element_ty
    # Arithmetic in float32, rounded to the input dtype where torch would round: the same numbers as the
    # reference, bit for bit in float32 (a 16-bit add or multiply is a float32 one, rounded).
    x32 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADDEND:
        x32 = (x32 + tl.load(addend_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(residual_ptr + offsets, x32.to(dtype), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = x + addend`` (or ``x``); rows are the last dimension. One kernel."""
    check_device(x, weight)
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(x2)
    if addend is None:
        residual, addend2 = x2, x2
    else:
        residual, addend2 = torch.empty_like(x2), addend.reshape(-1, hidden).contiguous()
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, addend2, weight, out, residual, hidden, eps, HAS_ADDEND=addend is not None, BLOCK=block
        )
    return out.view(shape), residual.view(shape)


def reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, addend: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch computation the kernel replaces."""
    h = x if addend is None else x + addend
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


def benchmark(num_tokens: int = 4096, hidden: int = 4096, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Fused add + norm against torch on the GPU: milliseconds and achieved GB/s of each."""
    x, a = (torch.randn(num_tokens, hidden, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    moved_bytes = 4 * x.numel() * x.element_size()  # read x and the addend, write h and norm(h)
    return compare(lambda: rms_norm(x, w, 1e-6, a), lambda: reference(x, w, 1e-6, a), moved_bytes, "gbps")

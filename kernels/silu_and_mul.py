"""SiLU-and-multiply, the middle of a SwiGLU MLP: ``silu(gate) * up`` from one fused ``[gate | up]`` tensor.

The gate and up projections are one matmul in minserve (``gate_up_proj``), so its output holds both halves
side by side. In torch, ``silu(gate) * up`` reads them, writes ``silu(gate)``, reads it back and writes the
product: three passes over memory. One kernel reads each input once and writes the output once.

    x [num_tokens, 2 * d]  →  out [num_tokens, d],  out = silu(x[:, :d]) * x[:, d:]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, compare


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[n, 2d]`` → ``[n, d]``: ``silu(x[:, :d]) * x[:, d:]``, computed in float32, stored in x's dtype."""
    check_device(x)
    x = x.contiguous()
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](x, out, d, x.stride(0), out.stride(0), BLOCK=block)
    return out


def reference(x: torch.Tensor) -> torch.Tensor:
    """The torch computation the kernel replaces (same float32 arithmetic)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def benchmark(num_tokens: int = 4096, d: int = 11008, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Kernel against the torch reference on the GPU: milliseconds and achieved GB/s of each."""
    x = torch.randn(num_tokens, 2 * d, device="cuda", dtype=dtype)
    moved_bytes = x.numel() * x.element_size() * 3 / 2  # read 2d, write d per token
    return compare(lambda: silu_and_mul(x), lambda: reference(x), moved_bytes, "gbps")

"""What every kernel file shares: the interpreter switch, the 8-bit KV cache's codes, and timing for the
benchmark entries.

Triton compiles kernels for a CUDA GPU. On a machine without one, ``TRITON_INTERPRET=1`` runs the same
kernels on the CPU, one program at a time in numpy: slow, but exact enough to test against the torch
references. The variable is read when ``triton`` is first imported, so it must be set before that.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)  # Triton's tl.float8e4nv; older torch builds lack it
# An 8-bit KV cache's code dtypes and their largest code: int8 codes are integers, e4m3 codes are floats.
# (The same codes as minserve.model.kv_quant writes: a cache stored by either side is read by the other.)
CODE_MAX: dict[torch.dtype, float] = {torch.int8: 127.0} | ({FP8_E4M3: 448.0} if FP8_E4M3 is not None else {})


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter; anything else is refused."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            continue
        if tensor.device.type == "cpu" and interpreting():
            continue
        raise ValueError(
            f"Triton kernels need CUDA tensors, got one on {tensor.device}; on a CPU set TRITON_INTERPRET=1 "
            "before importing triton (slow: for tests), or use the torch backend"
        )


def checked_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[2, num_kv_heads]`` float32 scales (keys' row 0, values' row 1) an 8-bit cache is read and
    written with; None for a 16- or 32-bit cache. A missing, extra or misshapen ``kv_scales`` is refused."""
    num_kv_heads = kv_cache.shape[-2]
    if kv_cache.dtype not in CODE_MAX:
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for an 8-bit KV cache; this one holds {kv_cache.dtype}")
        return None
    if kv_scales is None or tuple(kv_scales.shape) != (2, num_kv_heads):
        got = None if kv_scales is None else list(kv_scales.shape)
        raise ValueError(f"an 8-bit KV cache needs kv_scales of shape [2, {num_kv_heads}], got {got}")
    check_device(kv_scales)
    if kv_cache.dtype == FP8_E4M3:
        check_fp8_support(kv_cache.device)
    return kv_scales.to(torch.float32).contiguous()


def check_fp8_support(device: torch.device) -> None:
    """Triton has float8 e4m3 (``tl.float8e4nv``) from compute capability 8.9 (Ada, Hopper) on, and in the
    interpreter; an older GPU would fail to compile the kernel, with a less helpful message than this one."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "a float8 e4m3 KV cache needs a GPU of compute capability 8.9 or newer for the Triton kernels; "
            "use int8 codes (kv_cache_dtype='int8') or the torch backend"
        )


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def compare(kernel: Callable[[], object], torch_side: Callable[[], object], work: float, unit: str) -> dict[str, float]:
    """Time a kernel and its torch counterpart; ``work`` is what one call moves or computes, per ``unit``.

    ``unit`` is ``"gbps"`` (``work`` in bytes moved: the bound of a memory-bound kernel) or ``"tflops"``
    (``work`` in floating-point operations). Returns milliseconds and the achieved rate of each side.
    """
    scale = {"gbps": 1e6, "tflops": 1e9}[unit]  # work / ms / scale = GB/s or TFLOP/s
    kernel_ms, torch_ms = time_ms(kernel), time_ms(torch_side)
    return {"kernel_ms": kernel_ms, "torch_ms": torch_ms,
            f"kernel_{unit}": work / kernel_ms / scale, f"torch_{unit}": work / torch_ms / scale}  # fmt: skip


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, kv_scales: torch.Tensor | None = None
) -> torch.Tensor:
    """``[2, context_len, kv_heads, head_dim]``: one sequence's keys and values, read through its block table
    into a contiguous copy (what the torch references attend over). With ``kv_scales`` ``[2, kv_heads]`` the
    cache's 8-bit codes come back widened: float32, each times its KV head's key or value scale."""
    block_size = kv_cache.shape[2]
    context = kv_cache[:, block_table[: -(-context_len // block_size)]].flatten(1, 2)[:, :context_len]
    if kv_scales is None:
        return context
    return context.float() * kv_scales.float()[:, None, :, None]

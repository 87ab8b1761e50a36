"""What every kernel file shares: the interpreter switch, and timing for the benchmark entries.

Triton compiles kernels for a CUDA GPU. On a machine without one, ``TRITON_INTERPRET=1`` runs the same
kernels on the CPU, one program at a time in numpy: slow, but exact enough to test against the torch
references. The variable is read when ``triton`` is first imported, so it must be set before that.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


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


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """``[2, context_len, kv_heads, head_dim]``: one sequence's keys and values, read through its block table
    into a contiguous copy (what the torch references attend over)."""
    block_size = kv_cache.shape[2]
    return kv_cache[:, block_table[: -(-context_len // block_size)]].flatten(1, 2)[:, :context_len]

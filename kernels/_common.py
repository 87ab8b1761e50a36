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

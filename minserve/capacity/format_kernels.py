"""Each weight format's matmul, timed on its own: the kernel beneath a format's speed (or its slowness).

One call of a linear layer in each format, as the engine calls it (the modules of
:mod:`minserve.quant.linear`), beside float32 and bfloat16 ``F.linear``, and beside torch's int8 kernel fed
float32 activations (the slow path the int8 layer avoids by rounding its input to bfloat16). Chapter 07
and ``benchmarks/quantization.py`` both time with this.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from minserve.quant.formats import quantize
from minserve.quant.linear import Fp8Linear, Int4Linear, Int8Linear

Kernel = Callable[[torch.Tensor], torch.Tensor]
SLOW_SIDES = ("int8, fp32 in",)  # timed fewer times: tens of milliseconds a call


def kernel_sides(linear: nn.Linear) -> dict[str, Kernel]:
    """Each format's matmul on this layer's weight, as a function of the input ``[batch, in]``."""
    w = linear.weight.detach()
    bf16 = w.to(torch.bfloat16)
    int8 = Int8Linear(quantize(w, "int8"), None)
    return {
        "fp32": lambda x: F.linear(x, w),
        "bf16": lambda x: F.linear(x.to(torch.bfloat16), bf16),
        "int8": int8,
        "int8, fp32 in": lambda x: torch.ops.aten._weight_int8pack_mm(x, int8.codes, int8.scales.float()),
        "int4-g32": Int4Linear(quantize(w, "int4", 32), None),
        "int4-g64": Int4Linear(quantize(w, "int4", 64), None),
        "fp8": Fp8Linear(quantize(w, "fp8"), None),
    }


def time_us(fn: Callable[[], object], repeats: int) -> float:
    """Median microseconds of ``repeats`` calls, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def time_kernels(
    shapes: dict[str, tuple[int, int]],
    batches: Sequence[int] = (1, 32),
    repeats: int = 50,
    sides: Sequence[str] | None = None,
) -> pd.DataFrame:
    """µs per call, one row per (layer, batch), one column per format; ``shapes`` maps a layer's name to its
    ``(out, in)``. ``sides`` picks formats (default: all of :func:`kernel_sides`)."""
    rows = []
    with torch.inference_mode():
        for name, (out, inp) in shapes.items():
            kernels = kernel_sides(nn.Linear(inp, out, bias=False))
            chosen = {side: kernels[side] for side in (sides or kernels)}
            for batch in batches:
                x = torch.randn(batch, inp)
                times = {
                    side: time_us(lambda f=f, x=x: f(x), 3 if side in SLOW_SIDES else repeats)
                    for side, f in chosen.items()
                }
                rows.append({"layer": name, "shape": f"{out}×{inp}", "batch": batch} | times)
    return pd.DataFrame(rows)

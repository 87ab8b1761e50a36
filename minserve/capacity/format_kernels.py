"""Each weight format's matmul, timed on its own: the kernel beneath a format's speed (or its slowness).

One call of a linear layer in each format, as the engine calls it (the modules of
:mod:`minserve.quant.linear`), beside float32 and bfloat16 ``F.linear``, and beside torch's int8 kernel fed
float32 activations (the slow path the int8 layer avoids by rounding its input to bfloat16). Chapter 07
and ``benchmarks/quantization.py`` both time with this.

:func:`kernel_streaming` turns one-row times into the rate each kernel streams its weight (GB/s). The
roofline assumes every format's matmul reads its bytes at the machine's memory bandwidth; a kernel that
streams more slowly sets the time instead, and then fewer bytes need not mean less time. Timed with
``copies`` > 1, each call reads another copy of the layer, so the weight is not in the core's own cache
from the last call (a server's shared L3 of hundreds of MiB may still hold it).
"""

from __future__ import annotations

import functools
import itertools
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


SIDES = ("fp32", "bf16", "int8", "int8, fp32 in", "int4-g32", "int4-g64", "fp8")


def kernel_sides(linear: nn.Linear, sides: Sequence[str] = SIDES) -> dict[str, Kernel]:
    """Each format's matmul on this layer's weight, as a function of the input ``[batch, in]``; only
    ``sides`` are built (quantizing costs time)."""
    w = linear.weight.detach()
    build: dict[str, Callable[[], Kernel]] = {
        "fp32": lambda: lambda x: F.linear(x, w),
        "bf16": lambda: functools.partial(_bf16_linear, weight=w.to(torch.bfloat16)),
        "int8": lambda: Int8Linear(quantize(w, "int8"), None),
        "int8, fp32 in": lambda: functools.partial(_int8_fp32_in, layer=Int8Linear(quantize(w, "int8"), None)),
        "int4-g32": lambda: Int4Linear(quantize(w, "int4", 32), None),
        "int4-g64": lambda: Int4Linear(quantize(w, "int4", 64), None),
        "fp8": lambda: Fp8Linear(quantize(w, "fp8"), None),
    }
    return {side: build[side]() for side in sides}


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), weight)


def _int8_fp32_in(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, layer.codes, layer.scales.float())


def weight_bytes(out: int, inp: int, sides: Sequence[str] = SIDES) -> dict[str, int]:
    """Bytes of an ``[out, in]`` weight as each side's kernel reads it (codes, scales and zero points)."""
    element = {"fp32": 4, "bf16": 2}
    w = torch.zeros(out, inp)
    sized = {"int8": "int8", "int8, fp32 in": "int8", "int4-g32": ("int4", 32), "int4-g64": ("int4", 64)}
    sized |= {"fp8": "fp8"}
    result = {}
    for side in sides:
        if side in element:
            result[side] = out * inp * element[side]
        else:
            format, group = sized[side] if isinstance(sized[side], tuple) else (sized[side], 64)
            result[side] = quantize(w, format, group).nbytes
    return result


def time_us(fn: Callable[[], object], repeats: int, fastest: bool = False) -> float:
    """Median (or, ``fastest``, the least) microseconds of ``repeats`` calls, after two warm-up calls. The
    least is what the kernel can do: on a busy machine other work only ever adds time to a call."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * (min(times) if fastest else statistics.median(times))


def time_kernels(
    shapes: dict[str, tuple[int, int]],
    batches: Sequence[int] = (1, 32),
    repeats: int = 50,
    sides: Sequence[str] | None = None,
    copies: int = 1,
    fastest: bool = False,
) -> pd.DataFrame:
    """µs per call, one row per (layer, batch), one column per format; ``shapes`` maps a layer's name to its
    ``(out, in)``. ``sides`` picks formats (default: all of :func:`kernel_sides`). With ``copies`` > 1 the
    calls take turns over that many layers of the shape, so a call's weight is not in the core's cache from
    the last; ``fastest`` reports each side's fastest call instead of the median one (see :func:`time_us`)."""
    rows = []
    sides = tuple(sides or SIDES)
    with torch.inference_mode():
        for name, (out, inp) in shapes.items():
            layers = [kernel_sides(nn.Linear(inp, out, bias=False), sides) for _ in range(copies)]
            for batch in batches:
                x = torch.randn(batch, inp)
                times = {}
                for side in sides:
                    turns = itertools.cycle([layer[side] for layer in layers])
                    calls = 3 if side in SLOW_SIDES else repeats
                    times[side] = time_us(lambda turns=turns, x=x: next(turns)(x), calls * copies, fastest)
                rows.append({"layer": name, "shape": f"{out}×{inp}", "batch": batch} | times)
    return pd.DataFrame(rows)


def kernel_streaming(kernels: pd.DataFrame, bandwidth_bytes_per_s: float, batch: int = 1) -> pd.DataFrame:
    """From :func:`time_kernels`' table: per layer and side at ``batch``, the weight's MB, µs a call, the GB/s
    the kernel streamed its weight at, and that rate over the machine's measured ``bandwidth_bytes_per_s``
    (1: the roofline's assumption; well below 1: the kernel, not memory, sets the time)."""
    rows = []
    for _, row in kernels[kernels["batch"] == batch].iterrows():
        out, inp = (int(n) for n in row["shape"].split("×"))
        sides = [c for c in SIDES if c in row.index]
        for side, nbytes in weight_bytes(out, inp, sides).items():
            rate = nbytes / (row[side] * 1e-6)
            rows.append({
                "layer": row["layer"], "kernel": side, "weight (MB)": nbytes / 1e6, "µs": row[side],
                "GB/s": rate / 1e9, "of memory bandwidth": rate / bandwidth_bytes_per_s,
            })  # fmt: skip
    return pd.DataFrame(rows).set_index(["layer", "kernel"])

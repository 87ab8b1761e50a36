"""One weight in two formats, chosen per step by how many rows the step multiplies.

Chapter 03's roofline, applied to one layer. A decode step of a few sequences multiplies a handful of rows
by each weight: its time is the time to read the weight, so the fewer bytes a weight the faster, and int4
codes (half a byte) beat any float. A prefill chunk, or a decode batch of many sequences, multiplies
hundreds of rows by the same weight: its time is arithmetic, and a float GEMM (oneDNN's, on AVX-512, or on
AMX tiles in bfloat16) does that arithmetic several times faster than the int4 kernel, which has to widen
every code it reads. So on a CPU an engine serving a 4-bit checkpoint is fastest holding both: the codes
for small steps and a dense float copy for large ones (measured on SmolLM2's layers, 2-core Xeon: int4
0.17 ms against float32's 0.29 ms at one row, 7.3 against 5.1 ms at 128 rows).

Where the two cross depends on the machine (its bandwidth, its float units, torch's kernels), so
:func:`tune_row_switches` measures it once, when the model loads, on the model's own layers.

The two paths compute one function. The dense copy is the codes widened with their scales rounded as the
kernel rounds them (:func:`dense_twin`), and its inputs and outputs are rounded to bfloat16 as the kernel's
are, so the paths differ only in the order of their float32 sums. That matters more than it looks: a small
model's greedy choice is often a near tie (SmolLM2 puts "The" and "L" 0.08 nats apart as the first word of
"What is the capital of France?"), and when the dense copy held the file's float weights and float
activations, the same question answered "The capital of France is Paris." when its prompt was prefilled in
one large step and "L'Étoile, la Marseillaise, …" (as llama.cpp answers from this file) when its prompt
was cached and the few remaining rows went through the codes. Now it answers the second way both times.

The dense copy costs memory: a float32 copy of SmolLM2-135M's layers is 425 MB beside 60 MB of codes. That
is the price of the large steps' speed on a CPU, where memory is plentiful; on a GPU the codes' Triton
kernel serves both (:mod:`minserve.quant.linear`) and no copy is kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from minserve.quant.formats import QuantizedWeight
from minserve.quant.linear import ACTIVATION_DTYPE, QuantizedLinear

ROW_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)  # step sizes the crossover is looked for among
# The dense copies must win by this much before a step size goes to them: near the crossover the two are
# within noise of each other, and a busy machine's noise should not send small steps to the dense copies.
DENSE_MARGIN = 1.1


class RowSwitchedLinear(nn.Module):
    """``y = x Wᵀ + b`` through ``narrow`` (a quantized layer) for at most ``max_narrow_rows`` rows, through
    ``dense`` (an ``nn.Linear`` of the same weight, in ``dense.weight.dtype``) for more.

    The rule is on the step's shape alone, so a compiled decode step whose batch is known to be small
    (:mod:`minserve.engine.compilation`) traces only the narrow branch.
    """

    def __init__(self, narrow: QuantizedLinear, dense: nn.Linear, max_narrow_rows: int = 1) -> None:
        super().__init__()
        self.narrow, self.dense, self.max_narrow_rows = narrow, dense, max_narrow_rows
        self.in_features, self.out_features = narrow.in_features, narrow.out_features
        self.format = f"{narrow.format}+{str(dense.weight.dtype).removeprefix('torch.')}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = math.prod(x.shape[:-1])
        if rows <= self.max_narrow_rows:
            return self.narrow(x)
        # Rounded in and out as the packed kernels round (bfloat16), so both branches compute one function.
        y = self.dense(x.to(ACTIVATION_DTYPE).to(self.dense.weight.dtype))
        return y.to(ACTIVATION_DTYPE).to(x.dtype)

    def extra_repr(self) -> str:
        return f"max_narrow_rows={self.max_narrow_rows}"


def dense_twin(weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` in ``dtype`` holding the weight a packed kernel applies for ``weight``: the codes
    widened with their scales (and zero points) rounded to the kernel's bfloat16. In float32 that widening is
    exact (a 4- or 8-bit code times an 8-bit mantissa), so the twin multiplies by exactly the kernel's values."""
    applied = weight.with_scales_in(ACTIVATION_DTYPE).dequantize(dtype)
    dense = nn.Linear(applied.shape[1], applied.shape[0], bias is not None, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(applied)
        if bias is not None:
            dense.bias.copy_(bias.to(dtype))
    return dense.requires_grad_(False)


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX tiles). Without either, torch
    emulates bfloat16 matmuls and they run ~4× slower than float32 (measured: 60 against 240 GFLOP/s on a
    2-core Xeon VM without them), so the dense copy stays in float32 there."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def dense_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dense copy's dtype on a CPU: bfloat16 where the hardware multiplies it, else the model's."""
    return torch.bfloat16 if native_bfloat16() else model_dtype


@torch.inference_mode()
def tune_row_switches(
    model: nn.Module, activation_dtype: torch.dtype, candidates: tuple[int, ...] = ROW_CANDIDATES
) -> dict[str, int]:
    """Set every :class:`RowSwitchedLinear`'s ``max_narrow_rows``, per narrow format, and return them.

    For each format, the largest candidate step (rows of ``activation_dtype``) at which the model's layers
    of that format, run one after another in each format, are no slower in the narrow one. One after
    another because that is how a step runs them: a layer timed alone would sit in the CPU's cache, where
    a dense copy reads faster than it ever does from memory mid-step. The search stops at the first size
    where the dense copies win (by :data:`DENSE_MARGIN`), since from there on the arithmetic only grows; at
    least the first candidate, one row, which is what the narrow format is for.
    """
    by_format: dict[str, list[RowSwitchedLinear]] = {}
    for module in model.modules():
        if isinstance(module, RowSwitchedLinear):
            by_format.setdefault(module.narrow.format, []).append(module)
    chosen = {}
    for format, layers in by_format.items():
        chosen[format] = candidates[0]
        for rows in candidates:
            narrow_s = _layers_s(layers, rows, activation_dtype, narrow=True)
            if narrow_s > DENSE_MARGIN * _layers_s(layers, rows, activation_dtype):
                break
            chosen[format] = rows
        for module in layers:
            module.max_narrow_rows = chosen[format]
    return chosen


def _layers_s(layers: list[RowSwitchedLinear], rows: int, dtype: torch.dtype, narrow: bool = False) -> float:
    """Seconds to run ``rows`` rows of ``dtype`` through every one of ``layers``, in the narrow format or
    the dense one (the best of a few runs)."""
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers}
    if narrow:
        return _best_of(lambda: [layer.narrow(inputs[layer.in_features]) for layer in layers])
    return _best_of(lambda: [layer.dense(inputs[layer.in_features].to(layer.dense.weight.dtype)) for layer in layers])


def _best_of(call: Callable[[], object], repeats: int = 3) -> float:
    """The shortest of ``repeats`` timed calls (seconds), after one untimed call that packs and allocates."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)

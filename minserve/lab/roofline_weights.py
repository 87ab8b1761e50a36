"""Chapter 03: decode where it is bound by its weights, measured against a read-bandwidth roof.

A decode step of a model whose weights outgrow the CPU's caches must stream every weight from DRAM, so its
time at batch 1 is at least ``weight bytes ÷ read bandwidth``. :func:`measure_weight_bound` measures both
sides in alternating rounds (a read probe, then decode steps at a few small batches), so that load coming and
going on a shared machine touches both alike; the fastest of each counts, because load only ever adds time.
:func:`measure_kv_growth` times the same batch at a short and a long context: only the KV cache differs, so
the step grows by what reading it costs. :func:`regime_table` sets models side by side: a model bound by its
weights (the step ≈ the read, ≈ one pass through the matrices) and one bound by per-step overhead (the step
many times one pass through its matrices). Seconds and bytes unless a column says ms, MB or GB/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch

from minserve import capacity
from minserve.capacity import profiler
from minserve.capacity.profiler import DecodePoint, Profile
from minserve.capacity.roofline import Hardware, measure_read_bandwidth, predict_decode
from minserve.lab.anatomy_steps import weights_pass_s
from minserve.measure.prompts import RepeatedPrompts

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


@dataclass(frozen=True)
class WeightBound:
    """One engine's small-batch decode steps beside the time to read its weights once.

    ``hardware``: the roofs the predictions use (read bandwidth, the fastest over the rounds; matmul peak in
    the engine's dtype). ``points``: one per batch, each step the fastest over every round, its prediction on
    ``hardware``. ``weights_pass_s``: one token multiplied through every weight matrix and nothing else.
    ``rounds``: each round's read bandwidth (bytes/s) and median step per batch, to show the spread.
    """

    model: str
    dtype: str
    threads: int
    weight_bytes: int
    hardware: Hardware
    points: tuple[DecodePoint, ...]
    weights_pass_s: float
    rounds: tuple[tuple[float, dict[int, float]], ...]

    @property
    def weight_read_s(self) -> float:
        """The roofline's floor for any decode step: the weights once, at the measured read bandwidth."""
        return self.weight_bytes / self.hardware.memory_bandwidth_bytes_per_s

    def step_s(self, batch: int) -> float:
        """The fastest measured step at ``batch``."""
        return next(p.step_s for p in self.points if p.batch == batch)

    def as_profile(self) -> Profile:
        """The points as a decode-only :class:`~minserve.capacity.profiler.Profile`, for the roofline figure."""
        return Profile(self.model, "cpu", self.dtype, self.hardware, (), self.points, 0.0)


def measure_weight_bound(
    llm: LLM,
    batches: Sequence[int] = (1, 2, 4),
    context: int = 32,
    rounds: int = 3,
    steps: int = 6,
    read_mib: int = 256,
    pass_repeats: int = 5,
) -> WeightBound:
    """``rounds`` × (read probe, then ``steps`` pure decode steps at each batch of ``context`` tokens).

    The probe runs with the engine's thread count (the engine set torch's), since one core streams less than
    all of them. About ``rounds × (0.3 s + steps × Σ batches' steps)``: ~5 s for SmolLM2 in float32 on
    a quiet 2-core CPU, under a second for the embedded model.
    """
    dtype = str(llm.dtype).removeprefix("torch.")
    peak = capacity.measure_this_machine(copy_mib=16, device=llm.device.type, dtype=dtype).peak_flops_per_s
    measured, prompts = [], RepeatedPrompts(llm.model_config.vocab_size, seed=3)  # the same short prompts each round
    profiler.warm_up(llm, prompts)
    for _ in range(rounds):
        bandwidth = measure_read_bandwidth(read_mib, repeats=3, device=llm.device.type)
        hw = _hardware(peak, bandwidth, dtype)
        prompts.rewind()
        measured.append((bandwidth, profiler.profile_decode(llm, batches, (context,), steps, hw, _prompts=prompts)))
    hw = _hardware(peak, max(bw for bw, _ in measured), dtype)
    points = tuple(
        dataclasses.replace(
            per_round[0],
            step_s=min(t for p in per_round for t in p.steps_s),
            predicted=predict_decode(llm.model_config, per_round[0].batch, per_round[0].context_tokens, hw, dtype),
        )
        for per_round in zip(*(pts for _, pts in measured))
    )
    return WeightBound(
        model=llm.engine.config.checkpoint.model,
        dtype=dtype,
        threads=torch.get_num_threads(),
        weight_bytes=capacity.weights_read_bytes(llm.model_config, dtype),
        hardware=hw,
        points=points,
        weights_pass_s=weights_pass_s(llm, repeats=pass_repeats),
        rounds=tuple((bw, {p.batch: p.step_s for p in pts}) for bw, pts in measured),
    )


def _hardware(peak_flops_per_s: float, bandwidth: float, dtype: str) -> Hardware:
    return Hardware(
        name=f"this machine (CPU, {torch.get_num_threads()} threads)",
        peak_flops_per_s=peak_flops_per_s,
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_bytes=0,
        dtype=dtype,
        source="measured: float32 read probe (sum) and a matmul, best runs",
    )


@dataclass(frozen=True)
class KVGrowth:
    """The same batch decoding at a short and at a long context: fastest steps and predicted bytes each.

    ``bytes``: the roofline's bytes per step (weights once + every sequence's KV), short then long.
    ``steps_s``: the fastest step at each, over every round. ``kv_bytes``: the KV part of ``bytes``.
    """

    batch: int
    contexts: tuple[int, int]
    steps_s: tuple[float, float]
    bytes: tuple[float, float]
    kv_bytes: tuple[float, float]
    bandwidth_bytes_per_s: float

    @property
    def measured_growth(self) -> float:
        """How much longer the long-context step took: ``long / short − 1``."""
        return self.steps_s[1] / self.steps_s[0] - 1

    @property
    def predicted_growth(self) -> float:
        """How much more the long-context step must read: ``bytes long / bytes short − 1``."""
        return self.bytes[1] / self.bytes[0] - 1


def measure_kv_growth(
    llm: LLM,
    hardware: Hardware,
    batch: int = 2,
    contexts: tuple[int, int] = (32, 1536),
    rounds: int = 3,
    steps: int = 6,
) -> KVGrowth:
    """``rounds`` × (the batch at the short context, then at the long one), fastest step of each kept.

    The prompts repeat from round to round (:class:`~minserve.measure.prompts.RepeatedPrompts`), so only
    the first round pays the long prefill (most of this function's time: ``batch × long`` prompt tokens);
    later ones find it in the prefix cache. Within a round the sequences share nothing.
    """
    prompts = RepeatedPrompts(llm.model_config.vocab_size, seed=7)
    measured = []
    for _ in range(rounds):
        prompts.rewind()
        measured.append(profiler.profile_decode(llm, (batch,), contexts, steps, hardware, _prompts=prompts))
    short, long = ([p for pts in measured for p in pts if p.prompt_tokens == c] for c in contexts)
    kv_per_token = capacity.kv_bytes_per_token(llm.model_config, str(llm.dtype).removeprefix("torch."))
    return KVGrowth(
        batch=batch,
        contexts=(short[0].context_tokens, long[0].context_tokens),
        steps_s=(min(min(p.steps_s) for p in short), min(min(p.steps_s) for p in long)),
        bytes=(short[0].predicted.bytes, long[0].predicted.bytes),
        kv_bytes=tuple(batch * p[0].context_tokens * kv_per_token for p in (short, long)),
        bandwidth_bytes_per_s=hardware.memory_bandwidth_bytes_per_s,
    )


def regime_table(runs: Mapping[str, WeightBound], batch: int = 4) -> pd.DataFrame:
    """One row per engine: its weights, the read roof, the floor they set, the fastest steps at batch 1 and
    ``batch``, and the two ratios that tell the regimes apart: the step over the weight read (≈ 1 when bound
    by the weights) and the step over one measured pass through the matrices (≫ 1 when overhead binds)."""
    rows = []
    for name, run in runs.items():
        one = run.step_s(1)
        rows.append(
            {
                "engine": name,
                "weights MB": run.weight_bytes / 1e6,
                "read GB/s": run.hardware.memory_bandwidth_bytes_per_s / 1e9,
                "weights ÷ bandwidth ms": run.weight_read_s * 1e3,
                "step at batch 1 ms": one * 1e3,
                "step ÷ weight read": one / run.weight_read_s,
                "matmul pass ms": run.weights_pass_s * 1e3,
                "step ÷ matmul pass": one / run.weights_pass_s,
                f"step at {batch} ÷ step at 1": run.step_s(batch) / one,
                "tokens/s at batch 1": 1 / one,
            }
        )
    return pd.DataFrame(rows).set_index("engine")


def kv_growth_table(kv: KVGrowth) -> pd.DataFrame:
    """The two contexts side by side: KV and total bytes a step must read, the bound they set, the fastest
    step measured."""
    rows = [
        {
            "context (tokens)": context,
            "KV MB (all sequences)": kv_bytes / 1e6,
            "bytes per step MB": total / 1e6,
            "bytes ÷ bandwidth ms": total / kv.bandwidth_bytes_per_s * 1e3,
            "fastest step ms": step * 1e3,
        }
        for context, kv_bytes, total, step in zip(kv.contexts, kv.kv_bytes, kv.bytes, kv.steps_s)
    ]
    return pd.DataFrame(rows).set_index("context (tokens)")


def last_level_cache_bytes(cpu: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the highest-level cache the kernel reports for ``cpu`` (Linux sysfs), or ``None`` where it
    reports none. A virtual machine often reports the whole socket's cache, shared with every other tenant."""
    from pathlib import Path

    best: tuple[int, int] | None = None
    for index in sorted(Path(cpu).glob("index*")):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        size_b = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if best is None or level > best[0]:
            best = (level, size_b)
    return None if best is None else best[1]

"""Chapter 03's tables: the engine's profiled steps beside the roofline's bound, and GPUs predicted.

The numbers come from :mod:`minserve.capacity.roofline` (FLOPs, bytes, the hardware table) and
:mod:`minserve.capacity.profiler` (the engine, measured); this module only arranges them into DataFrames.
Times are in ms unless a column says ``_s``; intensities in FLOP/byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from minserve import capacity
from minserve.capacity.kv import Dtype, ModelLike
from minserve.capacity.roofline import HARDWARE, Hardware, attended_keys
from minserve.model.config import ModelConfig

if TYPE_CHECKING:
    from minserve.capacity.profiler import Profile

GPUS: tuple[str, ...] = tuple(HARDWARE)  # H100, H200, A100, L4, B200, MI300X


def resolve_hardware(hw: str | Hardware, extra: Mapping[str, Hardware] | None = None) -> Hardware:
    """A :class:`Hardware` as is, a name from ``extra`` (say, this machine as measured), or a table name."""
    if isinstance(hw, Hardware):
        return hw
    if extra and hw in extra:
        return extra[hw]
    return capacity.hardware(hw)


def profile_table(profile: Profile) -> pd.DataFrame:
    """One row per measured point: the work, the measured time beside the roofline's bound, and what it achieved.

    Columns: ``phase``, ``tokens`` (new tokens per sequence), ``batch``, ``context``, ``measured ms``,
    ``forward ms`` (the model alone, decode only), ``bound ms`` (the roofline's lower bound), ``× bound``
    (measured / bound, ≥ 1 when the bound holds), ``roof`` (which roof binds), ``FLOP/byte``, ``achieved
    GFLOP/s``, ``roof GFLOP/s`` (what the roof allows at that intensity) and ``tokens/s``.
    """
    rows = []
    hw = profile.hardware
    for row in profile.rows():
        new_tokens = row["tokens"] * row["batch"]
        forward_s = row["forward_s"]
        rows.append(
            {
                "phase": row["phase"],
                "tokens": row["tokens"],
                "batch": row["batch"],
                "context": row["context_tokens"],
                "measured ms": row["measured_s"] * 1e3,
                "forward ms": forward_s * 1e3 if forward_s is not None else float("nan"),
                "bound ms": row["predicted_s"] * 1e3,
                "× bound": row["measured_s"] / row["predicted_s"],
                "roof": row["bound"],
                "FLOP/byte": row["intensity_flops_per_byte"],
                "achieved GFLOP/s": row["flops"] / row["measured_s"] / 1e9,
                "roof GFLOP/s": capacity.attainable_flops_per_s(hw, row["intensity_flops_per_byte"]) / 1e9,
                "tokens/s": new_tokens / row["measured_s"],
            }
        )
    return pd.DataFrame(rows)


def attention_intensity_table(
    cases: Sequence[tuple[int, int]], dtype: Dtype = "bfloat16", queries_per_kv: Sequence[int] = (1, 4)
) -> pd.DataFrame:
    """Attention's FLOP/byte for ``(query tokens T, context tokens S)`` pairs, next to ``S·T/(S+T)``, and with
    the causal mask: a prefill (``T = S``) computes only ``S(S+1)/2`` of the ``S²`` pairs, so ≈ ``S/4``.

    One column per grouping ``g`` of query heads per KV head (1: multi-head attention, 4: Llama-3-8B's GQA).
    """
    rows = []
    for t, s in cases:
        row: dict[str, Any] = {"query tokens T": t, "context S": s, "S·T/(S+T)": s * t / (s + t)}
        for g in queries_per_kv:
            label = "MHA" if g == 1 else f"GQA g={g}"
            row[f"{label} ({dtype})"] = capacity.attention_intensity_flops_per_byte(t, s, dtype, g)
        # Causal: the i-th new query sees only the keys up to itself, so only attended_keys(T, S) of the S·T
        # pairs are computed (a kernel that skips the masked tiles); the bytes are the same.
        share = attended_keys(t, s) / (s * t)
        row[f"MHA causal ({dtype})"] = share * capacity.attention_intensity_flops_per_byte(t, s, dtype, 1)
        rows.append(row)
    return pd.DataFrame(rows)


def gpu_predictions_table(
    model: ModelLike,
    gpus: Sequence[str | Hardware] = GPUS,
    prompt_tokens: int = 2048,
    batch: int = 64,
    context_tokens: int = 2048,
    dtype: Dtype | None = None,
) -> pd.DataFrame:
    """Per accelerator: its roofs, its critical batch, and the model's predicted prefill and decode steps.

    Columns: ``peak TFLOP/s``, ``TB/s``, ``ridge FLOP/B``, ``critical batch``, ``prefill ms`` and its roof,
    decode step ms at batch 1 and at ``batch`` (each with its roof), decode ``tokens/s`` at ``batch``, and
    whether the weights plus that batch's KV cache fit in memory. ``dtype`` defaults to each one's own.
    """
    config = capacity.model_config(model)
    rows = []
    for entry in gpus:
        hw = resolve_hardware(entry)
        prefill = capacity.predict_prefill(config, prompt_tokens, hw, dtype)
        one = capacity.predict_decode(config, 1, context_tokens, hw, dtype)
        many = capacity.predict_decode(config, batch, context_tokens, hw, dtype)
        rows.append(
            {
                "GPU": hw.name,
                "peak TFLOP/s": hw.peak_flops_per_s / 1e12,
                "TB/s": hw.memory_bandwidth_bytes_per_s / 1e12,
                "ridge FLOP/B": hw.ridge_point_flops_per_byte,
                "critical batch": capacity.critical_batch_size(hw, dtype),
                f"prefill {prompt_tokens} ms": prefill.time_s * 1e3,
                "prefill roof": prefill.bound,
                "decode B=1 ms": one.time_s * 1e3,
                "decode B=1 roof": one.bound,
                f"decode B={batch} ms": many.time_s * 1e3,
                f"decode B={batch} roof": many.bound,
                f"tokens/s at B={batch}": batch / many.time_s,
                f"B={batch} fits": _fits(config, hw, batch, context_tokens, dtype),
            }
        )
    return pd.DataFrame(rows).set_index("GPU")


def decode_sweep(
    model: ModelLike,
    hw: str | Hardware,
    batches: Sequence[int],
    contexts_tokens: Sequence[int],
    dtype: Dtype | None = None,
) -> pd.DataFrame:
    """Predicted decode steps for every (context, batch): step time, tokens/s, roof, and whether it fits.

    Invariants: ``tokens/s == batch / step_s``; at a fixed context, step time never falls as batch grows.
    """
    config, hw = capacity.model_config(model), resolve_hardware(hw)
    rows = []
    for context in contexts_tokens:
        for batch in batches:
            p = capacity.predict_decode(config, batch, context, hw, dtype)
            rows.append(
                {
                    "context": context,
                    "batch": batch,
                    "step_s": p.time_s,
                    "tokens/s": batch / p.time_s,
                    "roof": p.bound,
                    "FLOP/byte": p.intensity_flops_per_byte,
                    "fits": _fits(config, hw, batch, context, dtype),
                }
            )
    return pd.DataFrame(rows)


def _fits(config: ModelConfig, hw: Hardware, batch: int, context_tokens: int, dtype: Dtype | None) -> bool:
    """Weights plus the batch's KV within the accelerator's whole memory (no allowance for anything else)."""
    return capacity.weights_and_kv_bytes(config, batch, context_tokens, dtype or hw.dtype) <= hw.memory_bytes

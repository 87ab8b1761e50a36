"""Chapter 08, where speculation stops paying: the step curve, the prediction by batch, and the same batch on
production GPUs.

* :func:`step_curve_table`: plain decode step time by tokens in the step, measured, beside this machine's
  roofline (a lower bound) and which roof binds it;
* :func:`batch_table`: per batch, v from the step curve, the speedup it predicts with a held-out α, and the
  speedup measured;
* :func:`stop_paying_figure`: the predicted speedup over the batch (step curve and roofline) with the
  measured points and the roofline's stop-paying batch;
* :func:`production_table`: the same arithmetic for public models on datasheet GPUs
  (:mod:`minserve.capacity.roofline`'s presets), weights only and with a KV cache to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from minserve.capacity.kv import kv_bytes_per_token, model_config
from minserve.capacity.memory import weights_bytes
from minserve.capacity.presets import MODEL_PRESETS
from minserve.capacity.roofline import critical_batch_size, hardware
from minserve.capacity.speculation import (
    expected_tokens_per_step,
    predicted_speedup,
    roofline_stop_paying_batch,
    stop_paying_batch,
)
from minserve.capacity.speculation_runs import SpeculationPoint, StepCurve
from minserve.lab.theme import SLO_COLOR, register_course_theme


def step_curve_table(points: Sequence[Any]) -> pd.DataFrame:
    """``profile_decode``'s points: tokens in the step, measured ms, roofline ms, the binding roof, and the
    measured time over the batch-1 step (a memory-bound step stays near 1)."""
    first = min(points, key=lambda p: p.batch).step_s
    rows = [
        {"tokens in the step": p.batch, "measured ms": p.step_s * 1e3, "roofline ms": p.predicted_s * 1e3,
         "roofline bound": p.predicted.bound, "× batch-1 step": p.step_s / first}
        for p in points
    ]  # fmt: skip
    return pd.DataFrame(rows).set_index("tokens in the step")


def batch_table(curve: StepCurve, acceptance: float, points: Sequence[SpeculationPoint]) -> pd.DataFrame:
    """Per measured batch: v = step(B·(k+1)) / step(B) from the curve, the speedup predicted with the
    held-out α (c = 0: prompt lookup), and the speedup measured on the run's own prompts."""
    rows = []
    for p in points:
        v = curve.verify_cost(p.batch, p.k)
        rows.append({
            "batch": p.batch, "k": p.k, "tokens verified per step": p.batch * (p.k + 1), "v (step curve)": v,
            "predicted": predicted_speedup(acceptance, p.k, 0.0, v), "measured": p.measured_speedup,
            "α in the run": p.acceptance, "same output": p.same_output,
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("batch")


def stop_paying_figure(
    curve: StepCurve,
    acceptance: float,
    k: int,
    critical_batch: float,
    points: Sequence[SpeculationPoint] = (),
    max_batch: int = 32,
) -> go.Figure:
    """Predicted speedup by batch: from the measured step curve, and from the roofline alone (v = max(1,
    B(k+1)/B*) / max(1, B/B*)), with the measured points and the roofline's stop-paying batch."""
    batches = list(range(1, max_batch + 1))
    expected = expected_tokens_per_step(acceptance, k)

    def roofline_v(b: int) -> float:
        return max(1.0, b * (k + 1) / critical_batch) / max(1.0, b / critical_batch)

    stop = stop_paying_batch(critical_batch, acceptance, k)
    fig = go.Figure()
    fig.add_scatter(x=batches, y=[expected / curve.verify_cost(b, k) for b in batches], name="step curve")
    fig.add_scatter(
        x=batches, y=[expected / roofline_v(b) for b in batches], name=f"roofline, B* = {critical_batch:.0f}",
        line={"dash": "dash"},
    )  # fmt: skip
    fig.add_scatter(
        x=[p.batch for p in points], y=[p.measured_speedup for p in points], mode="markers", name="measured",
        marker={"size": 12, "symbol": "diamond"},
    )  # fmt: skip
    fig.add_hline(y=1.0, line_dash="dot", line_color=SLO_COLOR, annotation_text="plain decoding")
    fig.add_vline(x=stop, line_dash="dot", annotation_text=f"roofline: stops paying at {stop:.1f}")
    fig.update_layout(
        title=f"Prompt lookup, k = {k}, α = {acceptance:.2f} (held out): speedup by batch",
        xaxis_title="batch (sequences per step)", yaxis_title="speedup (×)", xaxis_type="log",
        template=register_course_theme(), height=400,
    )  # fmt: skip
    return fig


def production_table(
    models: Sequence[str] = ("Llama-3-8B",),
    gpus: Sequence[str] = ("H100", "H200"),
    acceptances: Sequence[float] = (0.6, 0.8),
    k: int = 3,
    context_tokens: int = 1024,
) -> pd.DataFrame:
    """Where prompt lookup (c = 0) stops paying on datasheet GPUs in bf16: the critical batch B*, the
    stop-paying batch from the weights alone (B*·E/(k+1)), and with every sequence reading a ``context_tokens``
    KV cache (its k + 1 queries share one read), beside the largest batch whose KV fits in the GPU's memory."""
    rows = []
    for name in models:
        config = model_config(MODEL_PRESETS[name])
        for gpu in gpus:
            hw = hardware(gpu)
            fits = (hw.memory_bytes - weights_bytes(config, hw.dtype)) // (context_tokens * kv_bytes_per_token(config))
            for alpha in acceptances:
                with_kv = roofline_stop_paying_batch(config, hw, alpha, k, context_tokens, max_batch=int(fits))
                rows.append({
                    "model": name, "GPU": hw.name, "α": alpha, "k": k, "B*": critical_batch_size(hw),
                    "stops paying, weights only": stop_paying_batch(critical_batch_size(hw), alpha, k),
                    f"stops paying, {context_tokens}-token KV": "never, up to the batch that fits"
                    if with_kv >= fits else with_kv,
                    f"batch that fits at {context_tokens} tokens": int(fits),
                })  # fmt: skip
    return pd.DataFrame(rows).round(1)

"""Chapter 03's figures of accelerators predicted: every GPU's roofline with the model's phases across them,
and decode throughput by batch up to the critical batch.

Nothing here is measured: each number is :mod:`minserve.capacity.roofline`'s prediction for a model config on
a row of the hardware table. The chart pieces (roofs, vertical lines, log axes) are
:mod:`minserve.lab.roofline_figures`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from minserve import capacity
from minserve.capacity.kv import Dtype, ModelLike
from minserve.capacity.roofline import Hardware
from minserve.lab.roofline_figures import (
    GPU_COLORS,
    intensity_range,
    log_log_layout,
    roof_trace,
    short_number,
    vertical_line,
)
from minserve.lab.roofline_tables import GPUS, decode_sweep, resolve_hardware
from minserve.lab.theme import COLORWAY, SLO_COLOR


def gpu_rooflines_figure(
    model: ModelLike,
    gpus: Sequence[str | Hardware] = GPUS,
    prompt_tokens: int = 2048,
    batches: Sequence[int] = (1, 64),
    context_tokens: int = 2048,
    dtype: Dtype | None = None,
    title: str | None = None,
) -> go.Figure:
    """Every accelerator's roofline on one log-log chart, and the model's phases as vertical lines.

    A phase's intensity belongs to the work, not to the machine (for one dtype), so it is one vertical line
    that crosses every roof: left of a GPU's ridge it is memory-bound there, right of it compute-bound.
    ``dtype`` defaults to the first accelerator's.
    """
    config = capacity.model_config(model)
    hws = [resolve_hardware(entry) for entry in gpus]
    dtype = dtype or hws[0].dtype
    phases = {f"prefill {prompt_tokens}": capacity.predict_prefill(config, prompt_tokens, hws[0], dtype)}
    for b in batches:
        phases[f"decode B={b}"] = capacity.predict_decode(config, b, context_tokens, hws[0], dtype)
    intensities = [p.intensity_flops_per_byte for p in phases.values()]
    x_range = intensity_range(intensities, [hw.ridge_point_flops_per_byte for hw in hws])
    y_range = (
        min(x_range[0] * hw.memory_bandwidth_bytes_per_s for hw in hws) / 2,
        max(hw.peak_flops_per_s for hw in hws) * 2,
    )
    fig = go.Figure()
    for i, hw in enumerate(hws):
        fig.add_trace(roof_trace(hw, x_range, hw.name, GPU_COLORS[i % len(GPU_COLORS)]))
    for dash, (name, prediction) in zip(("solid", "dash", "dot", "dashdot", "longdash"), phases.items()):
        label = f"{name}: {short_number(prediction.intensity_flops_per_byte)} FLOP/byte"
        fig.add_trace(vertical_line(prediction.intensity_flops_per_byte, y_range, label, COLORWAY[0], dash))
    name = model if isinstance(model, str) else "model"
    title = title or f"{name} in {dtype}, context {context_tokens}: where each phase meets each roof"
    return log_log_layout(fig, title, "arithmetic intensity (FLOP/byte)", x_range, "attainable FLOP/s", y_range)


def critical_batch_figure(
    model: ModelLike,
    hw: str | Hardware = "H100",
    batches: Sequence[int] = tuple(2**i for i in range(11)),
    contexts_tokens: Sequence[int] = (128, 2048, 16384),
    dtype: Dtype | None = None,
    title: str | None = None,
) -> go.Figure:
    """Predicted decode throughput (tokens/s) against batch, one line per context, with the critical batch.

    Solid where weights and the batch's KV fit in the accelerator's memory, dotted where they do not. Read
    it as: while decode is memory-bound, a bigger batch shares one read of the weights among more sequences
    and tokens/s grows almost in proportion; the growth stops at the critical batch size (short contexts)
    or much earlier, when every sequence's own KV reads dominate (long contexts).
    """
    config, hw = capacity.model_config(model), resolve_hardware(hw)
    sweep = decode_sweep(config, hw, batches, contexts_tokens, dtype)
    fig = go.Figure()
    for i, context in enumerate(contexts_tokens):
        rows = sweep[sweep["context"] == context]
        color = COLORWAY[i % len(COLORWAY)]
        fitting = rows[rows["fits"]]
        fig.add_trace(
            go.Scatter(
                x=fitting["batch"],
                y=fitting["tokens/s"],
                mode="lines+markers",
                name=f"context {context}",
                line={"color": color},
                legendgroup=str(context),
            )
        )
        beyond = rows[~rows["fits"]]
        if len(beyond):
            joined = pd.concat([fitting.tail(1), beyond])
            fig.add_trace(
                go.Scatter(
                    x=joined["batch"],
                    y=joined["tokens/s"],
                    mode="lines+markers",
                    name=f"context {context}, does not fit",
                    line={"color": color, "dash": "dot"},
                    marker={"symbol": "x-thin-open"},
                    legendgroup=str(context),
                    showlegend=False,
                )
            )
    critical = capacity.critical_batch_size(hw, dtype)
    y_range = (sweep["tokens/s"].min() / 2, sweep["tokens/s"].max() * 2)
    fig.add_trace(vertical_line(critical, y_range, f"critical batch ≈ {critical:.0f}", SLO_COLOR, "dash"))
    x_range = (min(batches) / 1.5, max(*batches, critical) * 1.5)
    name = model if isinstance(model, str) else "model"
    title = title or f"{name} decode on {hw.name}: tokens/s by batch (dotted: does not fit in memory)"
    axes = ("batch (sequences decoding together)", x_range, "output tokens/s (whole batch)", y_range)
    return log_log_layout(fig, title, *axes)

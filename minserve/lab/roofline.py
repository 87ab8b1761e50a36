"""Chapter 03: the roofline drawn, the engine's measured points placed on it, GPU predictions, the explorer.

The numbers come from :mod:`minserve.capacity.roofline` (FLOPs, bytes, the hardware table and the probe) and
from :mod:`minserve.capacity.profiler` (the engine, measured); this module only arranges them into tables and
plotly figures. :func:`roofline_explorer_result` is the explorer widget's whole callback as a plain function
(tests call it directly), and :func:`roofline_explorer` only wires controls to it.

Conventions: a measured point sits on a roofline chart at its arithmetic intensity (the prediction's FLOPs
over its bytes, a property of the work, not of the machine) and at the FLOP/s it *achieved*
(``FLOPs / measured seconds``). The roof at that intensity is ``FLOPs / predicted seconds``, so a point under
the roof is a step slower than the roofline's lower bound, by exactly the factor it sits below it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import capacity
from minserve.capacity.kv import Dtype, ModelLike
from minserve.capacity.roofline import HARDWARE, Hardware, Prediction
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme

if TYPE_CHECKING:
    from minserve.capacity.profiler import Profile

GPUS: tuple[str, ...] = tuple(HARDWARE)  # H100, H200, A100, L4, B200, MI300X
ROOF_COLOR = "#444444"
# Many GPUs on one chart: one colour each, the measured-data blue left out so "this machine" keeps it.
GPU_COLORS = COLORWAY[1:]
SIDE_LEGEND = {"orientation": "v", "y": 1, "x": 1.02, "xanchor": "left", "yanchor": "top"}  # long legends


def resolve_hardware(hw: str | Hardware, extra: Mapping[str, Hardware] | None = None) -> Hardware:
    """A :class:`Hardware` as is, a name from ``extra`` (say, this machine as measured), or a table name."""
    if isinstance(hw, Hardware):
        return hw
    if extra and hw in extra:
        return extra[hw]
    return capacity.hardware(hw)


# --- the engine, measured -----------------------------------------------------------------------------------


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


def decode_cost_fit(profile: Profile, prompt_tokens: int | None = None) -> dict[str, float]:
    """A straight line through the measured decode step times against batch size, at one context length.

    ``step ≈ fixed + per_sequence × batch``: ``fixed_s`` is what a step costs before it does any work for a
    sequence (the Python around the model, launching every operator, reading the weights), ``per_sequence_s``
    what each extra sequence adds. ``prompt_tokens`` picks the decode sweep's context (default: the shortest).

    The line is a Theil–Sen fit (the median of the slopes between every pair of points, then the median
    intercept), not least squares: on a shared machine one step slowed down by another process would drag a
    least-squares line anywhere, while a median ignores it. Needs two or more batch sizes at that context.
    """
    contexts = sorted({d.prompt_tokens for d in profile.decode})
    if not contexts:
        raise ValueError("the profile has no decode points")
    context = contexts[0] if prompt_tokens is None else prompt_tokens
    points = sorted((d.batch, d.step_s) for d in profile.decode if d.prompt_tokens == context)
    slopes = [(s2 - s1) / (b2 - b1) for i, (b1, s1) in enumerate(points) for b2, s2 in points[i + 1 :] if b2 != b1]
    if not slopes:
        raise ValueError(f"need decode points at two or more batch sizes for context {context}")
    slope = statistics.median(slopes)
    intercept = statistics.median(s - slope * b for b, s in points)
    return {"context_tokens": float(context), "fixed_s": intercept, "per_sequence_s": slope}


def _roof_trace(hw: Hardware, x_range: tuple[float, float], name: str, color: str, dash: str | None = None):
    """The roof as three points, which log-log axes draw as the slanted line and the flat one."""
    low, high = x_range
    ridge = hw.ridge_point_flops_per_byte
    xs = [low, ridge, high] if low < ridge < high else [low, high]
    ys = [capacity.attainable_flops_per_s(hw, x) for x in xs]
    return go.Scatter(
        x=xs,
        y=ys,
        mode="lines",
        name=name,
        line={"color": color, "width": 2, "dash": dash},
        hovertemplate=f"{name}<br>%{{x:.3g}} FLOP/byte → %{{y:.3s}}FLOP/s<extra></extra>",
    )


def _x_range(intensities: Iterable[float], ridges: Iterable[float]) -> tuple[float, float]:
    values = [*intensities, *ridges]
    return min(values) / 4, max(values) * 4


def _vertical_line(x: float, y_range: tuple[float, float], name: str, color: str, dash: str = "dot") -> go.Scatter:
    """A vertical line as a trace, named in the legend. (``add_vline`` takes log10 positions on a log axis,
    and its annotations stretch the axes; a two-point trace is drawn where its data says.)"""
    return go.Scatter(
        x=[x, x],
        y=list(y_range),
        mode="lines",
        name=name,
        line={"color": color, "dash": dash, "width": 1.5},
        hovertemplate=f"{name}<extra></extra>",
    )


def _number(x: float) -> str:
    """Three significant figures, without an exponent for the sizes a chart meets: 1.05, 32, 1,942."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _log_axis(title: str, values_range: tuple[float, float], **extra: Any) -> dict[str, Any]:
    """A log axis fixed to ``values_range`` (given in data units; plotly wants log10 of them)."""
    low, high = values_range
    return {"type": "log", "title": title, "range": [math.log10(low), math.log10(high)], **extra}


def roofline_figure(profile: Profile, title: str | None = None) -> go.Figure:
    """The measured machine's roofline (log-log) with every profiled point placed at the FLOP/s it achieved.

    Filled markers: measured (prefill by prompt length; decode by batch, one colour per context). Open grey
    markers on the roof: the roofline's bound for the same work. Read it as: how far a point sits below the
    roof is how many times slower than the bound the engine was; left of the ridge the slanted roof
    (bandwidth) binds, right of it the flat roof (peak FLOP/s).
    """
    hw = profile.hardware
    rows = profile.rows()
    x_range = _x_range((r["intensity_flops_per_byte"] for r in rows), [hw.ridge_point_flops_per_byte])
    achieved = [r["flops"] / r["measured_s"] for r in rows]
    y_range = (min([*achieved, x_range[0] * hw.memory_bandwidth_bytes_per_s]) / 2, hw.peak_flops_per_s * 2)
    fig = go.Figure(_roof_trace(hw, x_range, "roof (measured probes)", ROOF_COLOR))
    ridge = hw.ridge_point_flops_per_byte
    fig.add_trace(_vertical_line(ridge, y_range, f"ridge point: {_number(ridge)} FLOP/byte", "gray"))
    fig.add_trace(
        go.Scatter(
            x=[r["intensity_flops_per_byte"] for r in rows],
            y=[r["flops"] / r["predicted_s"] for r in rows],
            mode="markers",
            name="roofline bound",
            marker={"symbol": "circle-open", "color": "gray", "size": 9},
            hoverinfo="skip",
        )
    )
    prefill = profile.prefill
    fig.add_trace(
        go.Scatter(
            x=[p.predicted.intensity_flops_per_byte for p in prefill],
            y=[p.predicted.flops / p.time_s for p in prefill],
            mode="markers+lines",
            name="prefill (prompt tokens)",
            marker={"color": COLORWAY[0], "size": 10},
            line={"width": 1},
            text=[_hover("prefill", f"{p.prompt_tokens} prompt tokens", p.time_s, p.predicted) for p in prefill],
            hovertemplate="%{text}<extra></extra>",
        )
    )
    contexts = sorted({d.prompt_tokens for d in profile.decode})
    for i, context in enumerate(contexts):
        points = [d for d in profile.decode if d.prompt_tokens == context]
        fig.add_trace(
            go.Scatter(
                x=[d.predicted.intensity_flops_per_byte for d in points],
                y=[d.predicted.flops / d.step_s for d in points],
                mode="markers+lines",
                name=f"decode, context ≈ {context} (batch)",
                marker={"color": COLORWAY[1 + i % (len(COLORWAY) - 1)], "size": 10, "symbol": "diamond"},
                line={"width": 1, "dash": "dot"},
                text=[
                    _hover("decode step", f"batch {d.batch}, context {d.context_tokens}", d.step_s, d.predicted)
                    for d in points
                ],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    default_title = (
        f"{hw.name}: peak {hw.peak_flops_per_s / 1e9:.0f} GFLOP/s, "
        f"{hw.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s; the engine's steps beneath"
    )
    fig.update_layout(
        template=register_course_theme(),
        title=title or default_title,
        xaxis=_log_axis("arithmetic intensity (FLOP/byte)", x_range),
        yaxis=_log_axis("FLOP/s (achieved; the roof: attainable)", y_range, exponentformat="SI"),
        legend=SIDE_LEGEND,
    )
    return fig


def _hover(phase: str, what: str, measured_s: float, predicted: Prediction) -> str:
    return (
        f"{phase}: {what}<br>measured {measured_s * 1e3:.3g} ms<br>"
        f"roofline bound {predicted.time_s * 1e3:.3g} ms ({predicted.bound}-bound)<br>"
        f"{predicted.intensity_flops_per_byte:.3g} FLOP/byte"
    )


def measured_vs_predicted_figure(profile: Profile, title: str | None = None) -> go.Figure:
    """Two log-log panels: prefill time by prompt length, decode step time by batch (one line per context);
    measured solid, the roofline's bound dashed, in the same colour."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefill: one prompt", "decode: one step of the batch"))
    prompts = [p.prompt_tokens for p in profile.prefill]
    fig.add_trace(
        go.Scatter(
            x=prompts,
            y=[p.time_s * 1e3 for p in profile.prefill],
            mode="lines+markers",
            name="prefill, measured",
            line={"color": COLORWAY[0]},
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=prompts,
            y=[p.predicted_s * 1e3 for p in profile.prefill],
            mode="lines+markers",
            name="prefill, roofline bound",
            line={"color": COLORWAY[0], "dash": "dash"},
            marker={"symbol": "circle-open"},
        ),
        row=1,
        col=1,
    )
    for i, context in enumerate(sorted({d.prompt_tokens for d in profile.decode})):
        points = [d for d in profile.decode if d.prompt_tokens == context]
        color = COLORWAY[1 + i % (len(COLORWAY) - 1)]
        batches = [d.batch for d in points]
        fig.add_trace(
            go.Scatter(
                x=batches,
                y=[d.step_s * 1e3 for d in points],
                mode="lines+markers",
                name=f"decode ctx ≈ {context}, measured",
                line={"color": color},
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(
                x=batches,
                y=[d.predicted_s * 1e3 for d in points],
                mode="lines+markers",
                name=f"decode ctx ≈ {context}, bound",
                line={"color": color, "dash": "dash"},
                marker={"symbol": "diamond-open"},
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(type="log", title_text="prompt tokens", row=1, col=1)
    fig.update_xaxes(type="log", title_text="batch (sequences)", row=1, col=2)
    fig.update_yaxes(type="log", title_text="ms", row=1, col=1)
    fig.update_yaxes(type="log", title_text="ms per step", row=1, col=2)
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"{profile.model} on {profile.hardware.name}: measured against the roofline's bound",
        legend=SIDE_LEGEND,
    )
    return fig


# --- GPUs, predicted ----------------------------------------------------------------------------------------


def attention_intensity_table(
    cases: Sequence[tuple[int, int]], dtype: Dtype = "bfloat16", queries_per_kv: Sequence[int] = (1, 4)
) -> pd.DataFrame:
    """Attention's FLOP/byte for ``(query tokens T, context tokens S)`` pairs, next to ``S·T/(S+T)``.

    One column per grouping ``g`` of query heads per KV head (1: multi-head attention, 4: Llama-3-8B's GQA).
    """
    rows = []
    for t, s in cases:
        row: dict[str, Any] = {"query tokens T": t, "context S": s, "S·T/(S+T)": s * t / (s + t)}
        for g in queries_per_kv:
            label = "MHA" if g == 1 else f"GQA g={g}"
            row[f"{label} ({dtype})"] = capacity.attention_intensity_flops_per_byte(t, s, dtype, g)
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


def _memory_needed_bytes(config, hw: Hardware, batch: int, context_tokens: int, dtype: Dtype | None) -> int:
    dtype = dtype or hw.dtype
    return capacity.weights_bytes(config, dtype) + capacity.kv_bytes_total(config, context_tokens, batch, dtype)


def _fits(config, hw: Hardware, batch: int, context_tokens: int, dtype: Dtype | None) -> bool:
    """Weights plus the batch's KV within the accelerator's whole memory (no allowance for anything else)."""
    return _memory_needed_bytes(config, hw, batch, context_tokens, dtype) <= hw.memory_bytes


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
    x_range = _x_range(intensities, [hw.ridge_point_flops_per_byte for hw in hws])
    y_range = (
        min(x_range[0] * hw.memory_bandwidth_bytes_per_s for hw in hws) / 2,
        max(hw.peak_flops_per_s for hw in hws) * 2,
    )
    fig = go.Figure()
    for i, hw in enumerate(hws):
        fig.add_trace(_roof_trace(hw, x_range, hw.name, GPU_COLORS[i % len(GPU_COLORS)]))
    for dash, (name, prediction) in zip(("solid", "dash", "dot", "dashdot", "longdash"), phases.items()):
        label = f"{name}: {_number(prediction.intensity_flops_per_byte)} FLOP/byte"
        fig.add_trace(_vertical_line(prediction.intensity_flops_per_byte, y_range, label, COLORWAY[0], dash))
    name = model if isinstance(model, str) else "model"
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"{name} in {dtype}, context {context_tokens}: where each phase meets each roof",
        xaxis=_log_axis("arithmetic intensity (FLOP/byte)", x_range),
        yaxis=_log_axis("attainable FLOP/s", y_range, exponentformat="SI"),
        legend=SIDE_LEGEND,
    )
    return fig


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
    fig.add_trace(_vertical_line(critical, y_range, f"critical batch ≈ {critical:.0f}", SLO_COLOR, "dash"))
    x_range = (min(batches) / 1.5, max(*batches, critical) * 1.5)
    name = model if isinstance(model, str) else "model"
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"{name} decode on {hw.name}: tokens/s by batch (dotted: does not fit in memory)",
        xaxis=_log_axis("batch (sequences decoding together)", x_range),
        yaxis=_log_axis("output tokens/s (whole batch)", y_range, exponentformat="SI"),
        legend=SIDE_LEGEND,
    )
    return fig


# --- the explorer -------------------------------------------------------------------------------------------


def roofline_explorer_result(
    model: ModelLike,
    hw: str | Hardware,
    batch: int,
    context_tokens: int,
    prompt_tokens: int | None = None,
    dtype: Dtype | None = None,
    hardware: Mapping[str, Hardware] | None = None,
) -> dict[str, Any]:
    """Everything the explorer shows for one model on one accelerator at one batch and context.

    Keys: ``hardware`` (its name), ``dtype``, ``decode_step_s``, ``decode_compute_s``, ``decode_memory_s``,
    ``decode_bound``, ``decode_intensity``, ``ridge``, ``critical_batch``, ``tokens_per_s`` (the whole batch),
    ``tokens_per_s_per_sequence``, ``prefill_tokens``, ``prefill_s``, ``prefill_bound``, ``memory_needed_bytes``
    (weights + the batch's KV), ``memory_bytes`` and ``fits``. ``prompt_tokens`` defaults to
    ``context_tokens``; ``hardware`` adds names to the table (this machine, measured). Invariants:
    ``decode_step_s == max(decode_compute_s, decode_memory_s)`` and ``tokens_per_s == batch / decode_step_s``.
    """
    if batch < 1 or context_tokens < 1:
        raise ValueError(f"batch and context must be positive, got {batch} and {context_tokens}")
    config, hw = capacity.model_config(model), resolve_hardware(hw, hardware)
    dtype = dtype or hw.dtype
    prompt_tokens = context_tokens if prompt_tokens is None else prompt_tokens
    decode = capacity.predict_decode(config, batch, context_tokens, hw, dtype)
    prefill = capacity.predict_prefill(config, prompt_tokens, hw, dtype)
    needed = _memory_needed_bytes(config, hw, batch, context_tokens, dtype)
    return {
        "hardware": hw.name,
        "dtype": str(dtype),
        "decode_step_s": decode.time_s,
        "decode_compute_s": decode.compute_s,
        "decode_memory_s": decode.memory_s,
        "decode_bound": decode.bound,
        "decode_intensity": decode.intensity_flops_per_byte,
        "ridge": hw.ridge_point_flops_per_byte,
        "critical_batch": capacity.critical_batch_size(hw, dtype),
        "tokens_per_s": batch / decode.time_s,
        "tokens_per_s_per_sequence": 1 / decode.time_s,
        "prefill_tokens": prompt_tokens,
        "prefill_s": prefill.time_s,
        "prefill_bound": prefill.bound,
        "memory_needed_bytes": needed,
        "memory_bytes": hw.memory_bytes,
        "fits": needed <= hw.memory_bytes,
    }


def format_seconds(s: float) -> str:
    """A duration in the unit that reads best: ``format_seconds(0.0042)`` → ``"4.20 ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}" if unit == "s" else f"{s / scale:.2f} {unit}"
    return f"{s * 1e9:.1f} ns"


def explorer_summary_html(result: Mapping[str, Any]) -> str:
    """The explorer's readout: a small HTML table and a verdict on which roof binds."""
    rows = [
        ("decode step", format_seconds(result["decode_step_s"])),
        ("  of which compute / memory", f"{format_seconds(result['decode_compute_s'])} / "
                                        f"{format_seconds(result['decode_memory_s'])}"),
        ("decode intensity / ridge", f"{result['decode_intensity']:.3g} / {result['ridge']:.3g} FLOP/byte"),
        ("tokens/s, whole batch", f"{result['tokens_per_s']:,.0f}"),
        ("tokens/s, each sequence", f"{result['tokens_per_s_per_sequence']:,.1f}"),
        ("critical batch", f"{result['critical_batch']:.0f}"),
        (f"prefill of {result['prefill_tokens']} tokens", f"{format_seconds(result['prefill_s'])} "
                                                          f"({result['prefill_bound']}-bound)"),
        ("weights + KV / memory", f"{result['memory_needed_bytes'] / 1e9:.1f} / {result['memory_bytes'] / 1e9:.0f} GB"),
    ]  # fmt: skip
    body = "".join(
        f"<tr><td style='padding:0 12px'>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in rows
    )
    verdict = f"decode is {result['decode_bound']}-bound on {result['hardware']} in {result['dtype']}"
    colour = "#009E73" if result["decode_bound"] == "compute" else "#0072B2"
    lines = [f"<p style='color:{colour};font-weight:bold'>{verdict}</p>"]
    if not result["fits"]:
        lines.append(f"<p style='color:{SLO_COLOR}'>the weights and this batch's KV cache do not fit in memory</p>")
    return f"<table>{body}</table>" + "".join(lines)


def roofline_explorer(
    models: Mapping[str, ModelLike] | None = None,
    hardware: Mapping[str, Hardware] | None = None,
    model: str = "Llama-3-8B",
    gpu: str = "H100",
    batch: int = 1,
    context_tokens: int = 2048,
) -> widgets.VBox:
    """GPU, model, batch and context controls above the predicted decode step, its roof and tokens/s.

    ``models`` and ``hardware`` add choices to the presets and the hardware table (the embedded model, this
    machine as measured).
    """
    extra_models, extra_hw = dict(models or {}), dict(hardware or {})
    choice = widgets.Dropdown(options=[*extra_models, *capacity.MODEL_PRESETS], value=model, description="model")
    gpu_box = widgets.Dropdown(options=[*GPUS, *extra_hw], value=gpu, description="hardware")
    batch_box = widgets.BoundedIntText(value=batch, min=1, max=1_000_000, description="batch")
    context = widgets.BoundedIntText(value=context_tokens, min=1, max=10_000_000, description="context")
    readout = widgets.HTML()
    controls = [choice, gpu_box, batch_box, context]

    def update(_change: object = None) -> None:
        try:
            target = extra_models.get(choice.value, choice.value)
            result = roofline_explorer_result(target, gpu_box.value, batch_box.value, context.value, hardware=extra_hw)
            readout.value = explorer_summary_html(result)
        except (ValueError, KeyError) as error:
            readout.value = f"<p style='color:{SLO_COLOR}'>{error}</p>"

    for control in controls:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls, readout])

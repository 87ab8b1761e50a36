"""Chapter 03's figures of the engine measured: the roofline drawn with the profiled steps placed on it, and
the steps' times beside the roofline's bound. Also the pieces every roofline chart is made of (the roof,
vertical lines, log axes), which :mod:`minserve.lab.gpu_figures` shares.

A measured point sits on a roofline chart at its arithmetic intensity (the prediction's FLOPs over its
bytes, a property of the work, not of the machine) and at the FLOP/s it *achieved* (``FLOPs / measured
seconds``). The roof at that intensity is ``FLOPs / predicted seconds``, so a point under the roof is a step
slower than the roofline's lower bound, by exactly the factor it sits below it. Every axis is log-log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import capacity
from minserve.capacity.roofline import Hardware, Prediction
from minserve.lab.theme import COLORWAY, register_course_theme

if TYPE_CHECKING:
    from minserve.capacity.profiler import Profile


ROOF_COLOR = "#444444"
# Many GPUs on one chart: one colour each, the measured-data blue left out so "this machine" keeps it.
GPU_COLORS = COLORWAY[1:]
SIDE_LEGEND = {"orientation": "v", "y": 1, "x": 1.02, "xanchor": "left", "yanchor": "top"}  # long legends


def roof_trace(
    hw: Hardware, x_range: tuple[float, float], name: str, color: str, dash: str | None = None
) -> go.Scatter:
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


def intensity_range(intensities: Iterable[float], ridges: Iterable[float]) -> tuple[float, float]:
    """The x range (FLOP/byte) of a roofline chart: every intensity and ridge, with a factor 4 to spare."""
    values = [*intensities, *ridges]
    return min(values) / 4, max(values) * 4


def vertical_line(x: float, y_range: tuple[float, float], name: str, color: str, dash: str = "dot") -> go.Scatter:
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


def short_number(x: float) -> str:
    """Three significant figures, without an exponent for the sizes a chart meets: 1.05, 32, 1,942."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def log_axis(title: str, values_range: tuple[float, float], **extra: Any) -> dict[str, Any]:
    """A log axis fixed to ``values_range`` (given in data units; plotly wants log10 of them)."""
    low, high = values_range
    return {"type": "log", "title": title, "range": [math.log10(low), math.log10(high)], **extra}


def log_log_layout(
    fig: go.Figure, title: str, x_title: str, x_range: tuple[float, float], y_title: str, y_range: tuple[float, float]
) -> go.Figure:
    """A roofline chart's layout: the course theme, both axes log and fixed to their ranges, the legend aside."""
    fig.update_layout(
        template=register_course_theme(),
        title=title,
        xaxis=log_axis(x_title, x_range),
        yaxis=log_axis(y_title, y_range, exponentformat="SI"),
        legend=SIDE_LEGEND,
    )
    return fig


def roofline_figure(profile: Profile, title: str | None = None) -> go.Figure:
    """The measured machine's roofline (log-log) with every profiled point placed at the FLOP/s it achieved.

    Filled markers: measured (prefill by prompt length; decode by batch, one colour per context). Open grey
    markers on the roof: the roofline's bound for the same work. Read it as: how far a point sits below the
    roof is how many times slower than the bound the engine was; left of the ridge the slanted roof
    (bandwidth) binds, right of it the flat roof (peak FLOP/s).
    """
    hw = profile.hardware
    rows = profile.rows()
    x_range = intensity_range((r["intensity_flops_per_byte"] for r in rows), [hw.ridge_point_flops_per_byte])
    achieved = [r["flops"] / r["measured_s"] for r in rows]
    y_range = (min([*achieved, x_range[0] * hw.memory_bandwidth_bytes_per_s]) / 2, hw.peak_flops_per_s * 2)
    fig = go.Figure(roof_trace(hw, x_range, "roof (measured probes)", ROOF_COLOR))
    ridge = hw.ridge_point_flops_per_byte
    fig.add_trace(vertical_line(ridge, y_range, f"ridge point: {short_number(ridge)} FLOP/byte", "gray"))
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
    axes = ("arithmetic intensity (FLOP/byte)", x_range, "FLOP/s (achieved; the roof: attainable)", y_range)
    return log_log_layout(fig, title or default_title, *axes)


def _measured_and_bound(
    fig: go.Figure,
    col: int,
    xs: list[int],
    measured_ms: list[float],
    bound_ms: list[float],
    name: str,
    color: str,
    symbol: str,
) -> None:
    """One sweep in panel ``col``: the measured times as a solid line, the roofline's bound dashed beside it."""
    fig.add_scatter(
        x=xs, y=measured_ms, mode="lines+markers", name=f"{name}, measured", line={"color": color}, row=1, col=col
    )
    fig.add_scatter(
        x=xs,
        y=bound_ms,
        mode="lines+markers",
        name=f"{name}, roofline bound",
        line={"color": color, "dash": "dash"},
        marker={"symbol": f"{symbol}-open"},
        row=1,
        col=col,
    )


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
    prefill = profile.prefill
    measured = [p.time_s * 1e3 for p in prefill]
    bound = [p.predicted_s * 1e3 for p in prefill]
    _measured_and_bound(fig, 1, [p.prompt_tokens for p in prefill], measured, bound, "prefill", COLORWAY[0], "circle")
    for i, context in enumerate(sorted({d.prompt_tokens for d in profile.decode})):
        points = [d for d in profile.decode if d.prompt_tokens == context]
        color = COLORWAY[1 + i % (len(COLORWAY) - 1)]
        measured, bound = [d.step_s * 1e3 for d in points], [d.predicted_s * 1e3 for d in points]
        name = f"decode ctx ≈ {context}"
        _measured_and_bound(fig, 2, [d.batch for d in points], measured, bound, name, color, "diamond")
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

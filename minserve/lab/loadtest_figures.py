"""Chapter 10's figures: the workload's lengths, coordinated omission, the knee of a rate sweep, ECDFs.

Like :mod:`minserve.lab.loadtest_tables`, each takes run summaries or record rows, so it draws a saved
bundle as well as a result in memory. Times are in ms, rates in requests per second.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import slo
from minserve.bench import bundle
from minserve.bench.rows import from_intended_ms, from_sent_ms
from minserve.capacity.queueing import predicted_ttft_ms
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme
from minserve.slo import lookup


def workload_figure(lengths: pd.DataFrame) -> go.Figure:
    """Histograms of prompt and output lengths (tokens), their mean and median marked."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["prompt tokens", "output tokens (max_tokens)"])
    for col, column in enumerate(("prompt_tokens", "output_tokens"), start=1):
        values = lengths[column].tolist()
        fig.add_trace(go.Histogram(x=values, nbinsx=30, marker_color=COLORWAY[col - 1], showlegend=False), 1, col)
        if values:
            marks = (
                ("median", slo.percentile(values, 50), "dot", "top left"),
                ("mean", statistics.fmean(values), "dash", "top right"),
            )
            for name, x, dash, where in marks:
                fig.add_vline(x=x, line_dash=dash, line_color="gray", annotation_text=name,
                              annotation_position=where, row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="tokens")
    fig.update_yaxes(title_text="requests", col=1)
    fig.update_layout(template=register_course_theme(), title=f"The workload: {len(lengths)} requests", bargap=0.05)
    return fig


def coordinated_omission_figure(rows: Iterable[Mapping[str, Any]], metric: str = "e2e") -> go.Figure:
    """Per run (side by side): each request's latency against its *intended* send time, from both send times.

    Filled markers: measured from the actual send (what the client reports). Open markers: from the intended
    send (what the user waited). Where the two part, the client fell behind its timetable.
    """
    groups = bundle.rows_by_run(rows)
    fig = make_subplots(rows=1, cols=max(1, len(groups)), subplot_titles=list(groups), shared_yaxes=True)
    for col, run_rows in enumerate(groups.values(), start=1):
        ok = [row for row in run_rows if row["status"] == "ok"]
        xs = [row["intended_s"] for row in ok]
        for name, measure, symbol, color in (
            ("from the intended send", from_intended_ms, "circle-open", SLO_COLOR),
            ("from the actual send", from_sent_ms, "circle", COLORWAY[0]),
        ):
            fig.add_scatter(
                x=xs, y=[measure(row, metric) for row in ok], mode="markers", name=name, legendgroup=name,
                marker={"symbol": symbol, "color": color, "size": 7}, showlegend=col == 1, row=1, col=col,
            )  # fmt: skip
    label = "E2E" if metric == "e2e" else "TTFT"
    fig.update_xaxes(title_text="intended send time (s into the run)")
    fig.update_yaxes(title_text=f"{label} (ms)", col=1)
    fig.update_layout(template=register_course_theme(), title=f"Coordinated omission: {label} from which send?")
    _legend_below(fig)
    return fig


def knee_figure(
    summaries: Sequence[Mapping[str, Any]],
    offered_rps: Sequence[float],
    capacity_rps: float,
    num_requests: int,
    base_ttft_ms: float,
) -> go.Figure:
    """Left: achieved against offered throughput, with the prediction min(λ, λ*). Right: TTFT p50 and p99
    against the offered rate, with the fluid-queue prediction of :func:`predicted_ttft_ms`. Both on log x."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["throughput (req/s)", "TTFT (ms)"])
    rates = list(offered_rps)
    grid = sorted({*rates, capacity_rps}) if rates else []
    achieved = [s["request_throughput_rps"] for s in summaries]
    fig.add_scatter(x=grid, y=grid, mode="lines", line={"dash": "dot", "color": "gray"}, name="achieved = offered",
                    row=1, col=1)  # fmt: skip
    predicted_throughput = [min(r, capacity_rps) for r in grid]
    fig.add_scatter(x=grid, y=predicted_throughput, mode="lines", line={"dash": "dash", "color": SLO_COLOR},
                    name="predicted min(λ, λ*)", row=1, col=1)  # fmt: skip
    fig.add_scatter(
        x=rates, y=achieved, mode="lines+markers", name="measured throughput", line_color=COLORWAY[0], row=1, col=1
    )
    for q, color in (("p50", COLORWAY[0]), ("p99", COLORWAY[1])):
        fig.add_scatter(x=rates, y=[lookup(dict(s), f"ttft_ms.{q}") for s in summaries], mode="lines+markers",
                        name=f"measured TTFT {q}", line_color=color, row=1, col=2)  # fmt: skip
    predicted = [predicted_ttft_ms(r, capacity_rps, num_requests, base_ttft_ms) for r in grid]
    fig.add_scatter(x=grid, y=predicted, mode="lines", line={"dash": "dash", "color": SLO_COLOR},
                    name="predicted TTFT p50", row=1, col=2)  # fmt: skip
    for col, axis in ((1, ""), (2, "2")):  # on a log axis a shape takes the value, an annotation its log10
        fig.add_vline(x=capacity_rps, line_dash="dot", line_color="gray", row=1, col=col)
        fig.add_annotation(x=math.log10(capacity_rps), y=1, xref=f"x{axis}", yref=f"y{axis} domain", text="λ*",
                           showarrow=False, xanchor="left", yanchor="top")  # fmt: skip
    fig.update_xaxes(type="log", title_text="offered rate λ (req/s)")
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(template=register_course_theme(), title="A rate sweep to the knee", height=500)
    _legend_below(fig)
    return fig


def ttft_ecdf_figure(groups: Mapping[str, Sequence[Mapping[str, Any]]], metric: str = "ttft_ms") -> go.Figure:
    """ECDFs of one metric (ms, ok requests) with one line per group of rows (``{name: rows}``)."""
    fig = go.Figure()
    for index, (name, rows) in enumerate(groups.items()):
        xs, ys = slo.ecdf_points(bundle.latencies_ms(rows, metric))
        fig.add_scatter(
            x=xs, y=ys, mode="lines", line_shape="hv", name=name, line_color=COLORWAY[index % len(COLORWAY)]
        )
    label = dict(bundle.METRICS_MS).get(metric, metric)
    fig.add_hline(y=0.99, line_dash="dot", line_color="gray", annotation_text="p99", annotation_position="left")
    fig.update_layout(template=register_course_theme(), title=f"{label}: empirical CDF", xaxis_title=label,
                      yaxis_title="fraction of requests ≤ x", yaxis_range=[0, 1.05])  # fmt: skip
    return fig


def _legend_below(fig: go.Figure) -> None:
    """Move the legend under the plot: above it, it collides with the subplot titles."""
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.2, "xanchor": "left", "x": 0},
                      margin={"b": 120})  # fmt: skip

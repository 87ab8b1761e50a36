"""Chapter 01's figures: the shape of a workload, and each request's latency predicted beside the measurement.

Each function returns a plotly ``Figure`` in the course theme; nothing is shown or saved here.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve.lab.theme import COLORWAY, register_course_theme
from minserve.workload import LengthDist, timetable


def workload_figure(
    rate_rps: float = 2.0,
    num_requests: int = 40,
    burstiness: float = 0.25,
    lengths: Mapping[str, LengthDist] | None = None,
    num_lengths: int = 2000,
    seed: int = 0,
) -> go.Figure:
    """Left: when ``num_requests`` requests arrive at ``rate_rps`` under three processes (constant gaps,
    Poisson, and gamma gaps of shape ``burstiness``, burstier than Poisson); one marker per request, seconds.
    Right: histograms of ``num_lengths`` draws from each length distribution, in tokens (default: a chat
    product's prompt and output lengths, both lognormal). All drawn by :mod:`minserve.workload`."""
    lengths = lengths or {
        "prompt tokens": LengthDist("lognormal", 400, 300, max_len=4096),
        "output tokens": LengthDist("lognormal", 200, 150, max_len=4096),
    }
    processes = {
        "constant": timetable(num_requests, rate_rps, "constant", seed=seed),
        "Poisson": timetable(num_requests, rate_rps, "poisson", seed=seed),
        f"gamma, burstiness {burstiness:g}": timetable(num_requests, rate_rps, "gamma", burstiness, seed=seed),
    }
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        subplot_titles=(f"arrivals at {rate_rps:g} requests/s on average", "request lengths"),
    )
    for i, (name, times) in enumerate(processes.items()):
        fig.add_trace(
            go.Scatter(
                x=times,
                y=[name] * len(times),
                mode="markers",
                marker={"symbol": "line-ns-open", "size": 16, "color": COLORWAY[i]},
                name=name,
                showlegend=False,
            ),
            row=1,
            col=1,
        )
    for i, (name, dist) in enumerate(lengths.items()):
        fig.add_trace(
            go.Histogram(
                x=dist.sample(num_lengths, seed + i),
                name=name,
                opacity=0.6,
                nbinsx=60,
                marker_color=COLORWAY[i + 3],
            ),
            row=1,
            col=2,
        )
    fig.update_layout(
        template=register_course_theme(),
        barmode="overlay",
        height=380,
        title="The shape of a workload",
        legend={"orientation": "v", "x": 0.99, "xanchor": "right", "y": 0.95, "yanchor": "top"},  # in the histogram
    )
    fig.update_xaxes(title_text="seconds since the first request", row=1, col=1)
    fig.update_xaxes(title_text="tokens", row=1, col=2)
    fig.update_yaxes(title_text="requests", row=1, col=2)
    return fig


def prediction_figure(table: pd.DataFrame, margin: float) -> go.Figure:
    """Each request's E2E (ms) against its output length: measured as markers, predicted as a line, with the
    ±``margin`` band the check allows, and the naive prediction (every step as cheap as one sequence's) dashed.

    ``table`` is :func:`minserve.lab.contract.prediction_table`'s, sorted by output length.
    """
    x = table["output tokens"]
    predicted = table["predicted E2E ms"]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=pd.concat([x, x[::-1]]),
            y=pd.concat([predicted * (1 + margin), (predicted / (1 + margin))[::-1]]),
            fill="toself",
            fillcolor="rgba(230, 159, 0, 0.15)",
            line={"width": 0},
            hoverinfo="skip",
            name=f"allowed: predicted ×/÷ {1 + margin:g}",
        )
    )
    fig.add_trace(
        go.Scatter(x=x, y=predicted, mode="lines", line={"color": COLORWAY[1]}, name="predicted: TTFT + Σ step(batch)")
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=table["one-sequence steps ms"],
            mode="lines",
            line={"color": COLORWAY[2], "dash": "dash"},
            name="TTFT + (n − 1) × one sequence's step",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=table["measured E2E ms"],
            mode="markers",
            marker={"color": COLORWAY[0], "size": 9},
            name="measured",
            text=table["request"],
        )
    )
    fig.update_layout(
        template=register_course_theme(),
        title="End-to-end latency per request: predicted from the step cost, then measured",
        xaxis_title="output tokens n",
        yaxis_title="end-to-end latency (ms)",
        legend={"orientation": "v", "x": 0.02, "xanchor": "left", "y": 0.98, "yanchor": "top"},
    )
    return fig

"""Chapter 05's simulator beside the engine: the cost model's step times against measured ones
(:func:`step_time_figure`), the simulator against the engine (:func:`validation_table`,
:func:`validation_figure`), policies swept over arrival rates (:func:`policy_sweep`, :func:`sweep_figure`),
and a long prompt in a stream of short ones (:func:`starvation_figure`).

The simulations themselves run in :mod:`minserve.capacity.experiments`; this module only tabulates and draws.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import slo
from minserve.capacity import experiments
from minserve.capacity.experiments import find_request
from minserve.capacity.simulator import SimResult
from minserve.lab.engine_runs import SIDE_LEGEND, EngineRun
from minserve.lab.theme import COLORWAY, register_course_theme

COMPARED: tuple[tuple[str, str], ...] = (
    # (key path in a summary, as slo.lookup reads it; the table's name for it)
    ("ttft_ms.p50", "TTFT p50 (ms)"),
    ("ttft_ms.p90", "TTFT p90 (ms)"),
    ("tpot_ms.p50", "TPOT p50 (ms)"),
    ("output_throughput_tps", "output tokens/s"),
)


def validation_table(
    measured: Mapping[str, Mapping[str, float]], simulated: Mapping[str, Mapping[str, float]]
) -> pd.DataFrame:
    """One row per (run, metric): ``measured``, ``simulated`` and ``sim / measured``, for the metrics in
    :data:`COMPARED`. ``measured`` and ``simulated`` map a run's label to its :func:`minserve.slo.summarize` dict."""
    rows = []
    for label, m in measured.items():
        s = simulated[label]
        for key, name in COMPARED:
            mine, sim = slo.lookup(m, key), slo.lookup(s, key)
            ratio = sim / mine if mine else math.nan
            rows.append({"run": label, "metric": name, "measured": mine, "simulated": sim, "sim / measured": ratio})
    return pd.DataFrame(rows).set_index(["run", "metric"])


def validation_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """One panel per metric of :func:`validation_table`: measured and simulated side by side for each run."""
    metrics = list(dict.fromkeys(table.index.get_level_values("metric")))
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics)
    for col, metric in enumerate(metrics, start=1):
        part = table.xs(metric, level="metric")
        for i, side in enumerate(("measured", "simulated")):
            fig.add_trace(
                go.Bar(
                    x=list(part.index),
                    y=part[side],
                    name=side,
                    legendgroup=side,
                    showlegend=col == 1,
                    marker_color=COLORWAY[i],
                    marker_pattern_shape="" if i == 0 else "/",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        template=register_course_theme(),
        barmode="group",
        title=title or "The simulator against the engine: the same requests, measured and simulated",
        height=380,
        legend=SIDE_LEGEND,
    )
    return fig


def policy_sweep(*args: Any, **kwargs: Any) -> pd.DataFrame:
    """:func:`minserve.capacity.experiments.policy_sweep` as a table: one row per (policy, rate).

    A summary's distributions become one column per statistic, named by key path (``ttft_ms.p50``, as
    :func:`minserve.slo.lookup` reads it)."""
    return pd.json_normalize(experiments.policy_sweep(*args, **kwargs))


def sweep_figure(sweep: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Three panels against the arrival rate, one line per policy: goodput, short requests' p99 TTFT and the
    longest TTFT of a long request (log scale: starvation is off the chart otherwise)."""
    panels = (
        ("goodput_rps", "goodput (requests/s meeting the SLO)", "linear"),
        ("ttft_short_p99_ms", "short requests: p99 TTFT (ms)", "log"),
        ("ttft_long_max_ms", "long requests: longest TTFT (ms)", "log"),
    )
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels], horizontal_spacing=0.08)
    for i, (policy, part) in enumerate(sweep.groupby("policy", sort=False)):
        for col, (key, _, _) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scatter(
                    x=part["rate_rps"],
                    y=part[key],
                    mode="lines+markers",
                    name=policy,
                    legendgroup=policy,
                    showlegend=col == 1,
                    line={"color": COLORWAY[i % len(COLORWAY)]},
                ),
                row=1,
                col=col,
            )
    for col, (_, _, axis) in enumerate(panels, start=1):
        fig.update_xaxes(title_text="arrival rate (requests/s)", row=1, col=col)
        fig.update_yaxes(type=axis, row=1, col=col)
    fig.update_layout(
        template=register_course_theme(),
        height=420,
        title=title or "Policies × arrival rates, simulated",
        legend=SIDE_LEGEND,
    )
    return fig


def starvation_figure(
    results: Mapping[str, SimResult],
    request_id: str = "long",
    stream_ends_s: float | None = None,
    title: str | None = None,
) -> go.Figure:
    """Requests waiting over virtual time, one line per policy, with a ◆ where ``request_id`` got its first
    token and a ■ where it finished; ``stream_ends_s`` draws when the last request arrived."""
    fig = go.Figure()
    for i, (label, result) in enumerate(results.items()):
        color = COLORWAY[i % len(COLORWAY)]
        times = [s.start_s for s in result.steps]
        waiting = [s.num_waiting for s in result.steps]
        # At most ~500 points a line (every k-th step, and the last): the same picture, a fraction of the bytes.
        stride = max(1, -(-len(waiting) // 500))
        keep = sorted({*range(0, len(waiting), stride), len(waiting) - 1} - {-1})
        fig.add_trace(
            go.Scatter(
                x=[times[i] for i in keep],
                y=[waiting[i] for i in keep],
                name=f"{label}: waiting",
                line_shape="hv",
                line={"color": color, "dash": ("solid", "dash", "dot", "dashdot")[i % 4]},
                legendgroup=label,
            )
        )
        request = find_request(result, request_id)
        marks = [(request.metrics.token_times_s[0], "diamond", "first token"),
                 (request.metrics.finish_time_s, "square", "finished")]  # fmt: skip
        for t, symbol, what in marks:
            at = bisect.bisect_right(times, t) - 1  # the last step that began by then
            y = result.steps[at].num_waiting if at >= 0 else 0
            fig.add_trace(
                go.Scatter(
                    x=[t],
                    y=[y],
                    mode="markers",
                    name=f"{label}: {request_id} {what}",
                    legendgroup=label,
                    marker={"symbol": symbol, "size": 12, "color": color, "line": {"color": "black", "width": 1}},
                    hovertemplate=f"{label}: {request_id} {what} at %{{x:.2f}} s<extra></extra>",
                )
            )
    if stream_ends_s is not None:
        fig.add_vline(x=stream_ends_s, line_dash="dot", line_color="gray", annotation_text="last arrival")
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"Requests waiting, and when the {request_id} request ran (simulated)",
        xaxis_title="virtual time (s)",
        yaxis_title="requests waiting",
        legend=SIDE_LEGEND,
    )
    return fig


def step_time_figure(
    runs: Mapping[str, EngineRun], predicted_ms: Mapping[str, pd.Series], title: str | None = None
) -> go.Figure:
    """Per run, every step's measured time (●) and the cost model's prediction of it (line), in ms against the
    step, on a log scale: where the two meet, the cost model can stand in for the engine."""
    fig = go.Figure()
    for i, (label, run) in enumerate(runs.items()):
        color = COLORWAY[i % len(COLORWAY)]
        fig.add_trace(
            go.Scatter(
                x=run.steps["step"],
                y=run.steps["duration_s"] * 1e3,
                mode="markers",
                name=f"{label}: measured",
                legendgroup=label,
                marker={"color": color, "size": 6},
            )
        )
        predicted = predicted_ms[label]
        fig.add_trace(
            go.Scatter(
                x=list(predicted.index),
                y=list(predicted.values),
                name=f"{label}: cost model",
                legendgroup=label,
                line={"color": color, "dash": "dash"},
                line_shape="hv",
            )
        )
    fig.update_layout(
        template=register_course_theme(),
        title=title or "Step times: measured against the calibrated cost model",
        xaxis_title="engine step",
        yaxis_title="step time (ms)",
        yaxis_type="log",
        legend=SIDE_LEGEND,
    )
    return fig

"""Chapter 05's figures and tables: who ran when, chunked prefill, waiting against running, and the
simulator laid beside the engine and swept over policies and rates.

* **a run of the engine** (:mod:`minserve.lab.engine_runs`): the step-occupancy (Gantt) view of who ran when
  (:func:`occupancy_figure`), tokens per step and the inter-token latency of running decodes
  (:func:`chunked_prefill_figure`), time spent waiting against running (:func:`waiting_running_figure`);
* **the simulator** (:mod:`minserve.capacity.experiments` runs it): the simulator beside the engine
  (:func:`validation_table`, :func:`validation_figure`), policies swept over arrival rates
  (:func:`policy_sweep`, :func:`sweep_figure`), and a long prompt in a stream of short ones
  (:func:`starvation_figure`).

The scheduling playground widget is in :mod:`minserve.lab.playground`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import slo
from minserve.capacity import experiments
from minserve.capacity.experiments import (
    find_request,
)
from minserve.capacity.simulator import (
    SimResult,
)
from minserve.lab.engine_runs import SIDE_LEGEND, STATE_COLORS, EngineRun
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme

if TYPE_CHECKING:
    pass


# --- figures of a run ---------------------------------------------------------------------------------------


def occupancy_segments(run: EngineRun) -> pd.DataFrame:
    """The occupancy as runs of consecutive steps in one state: ``request_id``, ``state``, ``first``, ``last``
    (steps, inclusive), ``tokens`` (run in the segment)."""
    occ = run.occupancy
    if occ.empty:
        return pd.DataFrame(columns=["request_id", "state", "first", "last", "tokens"])
    rows = []
    for rid, group in occ.sort_values("step", kind="stable").groupby("request_id", sort=False):
        current: list[Any] | None = None
        for step, state, tokens in zip(group["step"], group["state"], group["tokens"]):
            if current is not None and current[1] == state and step == current[3] + 1:
                current[3] = step
                current[4] += tokens
                continue
            if current is not None:
                rows.append(current)
            current = [rid, state, step, step, tokens]
        rows.append(current)
    return pd.DataFrame(rows, columns=["request_id", "state", "first", "last", "tokens"])


def occupancy_figure(
    runs: Mapping[str, EngineRun] | EngineRun, title: str | None = None, show_waiting: bool = True
) -> go.Figure:
    """Who ran when: one row per request (in arrival order, the first on top), one bar per stretch of steps in
    one state, coloured by :data:`STATE_COLORS`; an ✕ where a request was preempted. Several runs are stacked
    on one step axis, so a run that took more steps is visibly longer."""
    runs = {"": runs} if isinstance(runs, EngineRun) else dict(runs)
    fig = make_subplots(
        rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[k for k in runs]
    )
    shown: set[str] = set()
    for row, run in enumerate(runs.values(), start=1):
        segments = occupancy_segments(run)
        order = [rid for rid in run.request_ids if rid in set(run.occupancy["request_id"])]
        for state, color in STATE_COLORS.items():
            if state == "waiting" and not show_waiting:
                continue
            part = segments[segments["state"] == state]
            if part.empty:
                continue
            fig.add_trace(
                go.Bar(
                    y=part["request_id"],
                    x=part["last"] - part["first"] + 1,
                    base=part["first"] - 0.5,
                    orientation="h",
                    name=state,
                    legendgroup=state,
                    showlegend=state not in shown,
                    marker={"color": color, "line": {"width": 0}},
                    customdata=np.stack([part["first"], part["last"], part["tokens"]], axis=-1),
                    hovertemplate=f"request %{{y}}: {state}, steps %{{customdata[0]}}–%{{customdata[1]}}, "
                    "%{customdata[2]} tokens<extra></extra>",
                ),
                row=row,
                col=1,
            )
            shown.add(state)
        if run.preemptions:
            fig.add_trace(
                go.Scatter(
                    x=[s for s, _ in run.preemptions],
                    y=[rid for _, rid in run.preemptions],
                    mode="markers",
                    name="preempted",
                    legendgroup="preempted",
                    showlegend="preempted" not in shown,
                    marker={"symbol": "x", "color": "black", "size": 9},
                    hovertemplate="request %{y} preempted at step %{x}<extra></extra>",
                ),
                row=row,
                col=1,
            )
            shown.add("preempted")
        fig.update_yaxes(
            categoryorder="array", categoryarray=order[::-1], title_text="request", row=row, col=1, showgrid=False
        )
    fig.update_xaxes(title_text="engine step", row=len(runs), col=1)
    fig.update_layout(
        template=register_course_theme(),
        barmode="overlay",
        bargap=0.15,
        height=max(320, 260 * len(runs)),
        title=title or "Step occupancy: what each request did at every step",
        legend=SIDE_LEGEND,
    )
    return fig


def chunked_prefill_figure(
    runs: Mapping[str, EngineRun],
    decode_ids: Sequence[str],
    budget: int,
    arrival_step: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """Top: tokens run in each step, per run, with the step budget. Bottom: the gap before each token of the
    requests in ``decode_ids`` (ms), at the step that gave the token. ``arrival_step`` marks when the long
    prompt arrived."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("tokens run per step", "inter-token latency of the running decodes (ms)"),
    )
    for i, (label, run) in enumerate(runs.items()):
        color = COLORWAY[i % len(COLORWAY)]
        fig.add_trace(
            go.Scatter(
                x=run.steps["step"],
                y=run.steps["tokens"],
                name=f"{label}: tokens/step",
                line_shape="hv",
                line={"color": color},
                legendgroup=label,
            ),
            row=1,
            col=1,
        )
        itl = run.itl_ms(decode_ids)
        fig.add_trace(
            go.Scatter(
                x=itl["step"],
                y=itl["itl_ms"],
                mode="markers",
                name=f"{label}: ITL",
                legendgroup=label,
                marker={"color": color, "size": 6, "symbol": "circle" if i == 0 else "diamond"},
                text=itl["request_id"],
                hovertemplate="request %{text}, step %{x}: %{y:.1f} ms<extra></extra>",
            ),
            row=2,
            col=1,
        )
    last = max(int(run.steps["step"].max()) for run in runs.values())
    fig.add_trace(
        go.Scatter(
            x=[0.5, last + 0.5],
            y=[budget, budget],
            mode="lines",
            name=f"budget: {budget} tokens",
            line={"color": SLO_COLOR, "dash": "dash"},
        ),
        row=1,
        col=1,
    )
    if arrival_step is not None:
        fig.add_vline(x=arrival_step + 0.5, line_dash="dot", line_color="gray")
    fig.update_yaxes(type="log", title_text="tokens", row=1, col=1)
    fig.update_yaxes(type="log", title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text="engine step", row=2, col=1)
    fig.update_layout(
        template=register_course_theme(),
        height=560,
        title=title or "A long prompt arrives among running decodes (dotted line)",
        legend=SIDE_LEGEND,
    )
    return fig


def waiting_running_figure(runs: Mapping[str, EngineRun] | EngineRun, title: str | None = None) -> go.Figure:
    """Per request, in arrival order: its end-to-end time split into waiting (queued or preempted) and running
    (``metrics.waiting_s`` and ``metrics.running_s``), stacked, in ms. Several runs side by side, one y axis."""
    runs = {"": runs} if isinstance(runs, EngineRun) else dict(runs)
    fig = make_subplots(rows=1, cols=len(runs), shared_yaxes=True, subplot_titles=list(runs), horizontal_spacing=0.04)
    for col, run in enumerate(runs.values(), start=1):
        table = run.table()
        labels = [f"{rid} ({reason})" if reason not in ("length", "stop") else rid
                  for rid, reason in zip(table.index, table["finish"])]  # fmt: skip
        for name, column, state in (("waiting", "waiting ms", "waiting"), ("running", "running ms", "decode")):
            fig.add_trace(
                go.Bar(
                    x=labels,
                    y=table[column],
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    marker_color=STATE_COLORS[state],
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="request (arrival order)", row=1, col=col)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_layout(
        template=register_course_theme(),
        barmode="stack",
        title=title or "Where each request's time went: waiting vs running",
        legend=SIDE_LEGEND,
    )
    return fig


# --- the simulator ------------------------------------------------------------------------------------------


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

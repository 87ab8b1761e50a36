"""Chapter 05's figures of a run of the engine (:mod:`minserve.lab.engine_runs`): the step-occupancy (Gantt)
view of who ran when, with predicted step counts drawn on it (:func:`occupancy_figure`), tokens per step and
the inter-token latency of running decodes (:func:`chunked_prefill_figure`), and time spent waiting against
running (:func:`waiting_running_figure`).

The simulator's tables and figures are in :mod:`minserve.lab.simulation_figures`, the chapter's checks in
:mod:`minserve.lab.scheduling_checks`, the scheduling playground widget in :mod:`minserve.lab.playground`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve.lab.engine_runs import SIDE_LEGEND, STATE_COLORS, EngineRun
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme

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
    runs: Mapping[str, EngineRun] | EngineRun,
    title: str | None = None,
    show_waiting: bool = True,
    predicted_steps: Mapping[str, Mapping[str, float]] | None = None,
) -> go.Figure:
    """Who ran when: one row per request (in arrival order, the first on top), one bar per stretch of steps in
    one state, coloured by :data:`STATE_COLORS`; an ✕ where a request was preempted. Several runs are stacked
    on one step axis, so a run that took more steps is visibly longer.

    ``predicted_steps`` maps a run's label to named step counts (``{"predicted": 91}``), each drawn as a
    dashed vertical line after that many steps: a prediction laid on the measurement it predicts."""
    runs = {"": runs} if isinstance(runs, EngineRun) else dict(runs)
    fig = make_subplots(
        rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[k for k in runs]
    )
    shown: set[str] = set()
    for row, (label, run) in enumerate(runs.items(), start=1):
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
        for i, (name, steps) in enumerate((predicted_steps or {}).get(label, {}).items()):
            fig.add_vline(
                x=steps + 0.5,  # after that many steps: bars span step k as [k − 0.5, k + 0.5]
                line_dash=("dash", "dot")[i % 2],
                line_color=SLO_COLOR,
                annotation_text=f"{name}: {steps:g} steps",
                annotation_position="top right" if i % 2 == 0 else "bottom right",
                row=row,
                col=1,
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

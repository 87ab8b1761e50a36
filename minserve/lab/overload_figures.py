"""Chapter 09's figures and tables of overload: attainment, refusals and TTFT against the offered load, the
retry storm's offered load over time, and every request accounted for.

Each takes the plain tables the experiments return, so it draws a simulated sweep
(:func:`minserve.capacity.experiments.overload_sweep`) and a measured one
(:func:`minserve.bench.overload.overload_table`) alike: one row per (``policy``, ``load_multiple``), with
``sent``, ``refused``, ``attainment_admitted``, ``attainment_all``, ``ttft_p99_s`` among the columns. Load
is a multiple of the measured capacity; times are seconds, rates requests per second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme

# Accounting for a served request: the outcomes, each request in exactly one.
OUTCOMES = ("succeeded", "refused", "timed_out", "failed")


def refusal_share(table: pd.DataFrame) -> pd.Series:
    """Share of the requests sent that were refused at once (the simulator's ``refusal_share``, else
    ``refused / sent``)."""
    if "refusal_share" in table:
        return table["refusal_share"]
    return table["refused"] / table["sent"]


def _label(text: str | None, position: str) -> dict:
    """A line's annotation at ``position``, or none at all (plotly writes "new text" for an annotation with
    a position and no text)."""
    return {} if text is None else {"annotation_text": text, "annotation_position": position}


def overload_figure(sides: Mapping[str, pd.DataFrame], slo_ttft_s: float, title: str = "") -> go.Figure:
    """One column per table of ``sides`` (``{"simulator": ..., "server": ...}``), side by side; one colour
    per policy. Top: attainment of the admitted requests (solid) and of all sent (dotted). Middle: the share
    refused at the door. Bottom: the admitted requests' p99 TTFT on a log axis, the TTFT SLO dashed."""
    fig = make_subplots(rows=3, cols=len(sides), subplot_titles=list(sides), shared_xaxes=True, vertical_spacing=0.07)
    policies = list(dict.fromkeys(p for table in sides.values() for p in table["policy"]))
    colors = {policy: COLORWAY[i % len(COLORWAY)] for i, policy in enumerate(policies)}
    for col, table in enumerate(sides.values(), start=1):
        for policy, rows in table.sort_values("load_multiple").groupby("policy", sort=False):
            traces = (  # (row, values, dash, what the hover says)
                (1, rows["attainment_admitted"], "solid", "%{y:.0%} of admitted met the SLO"),
                (1, rows["attainment_all"], "dot", "%{y:.0%} of all sent met the SLO"),
                (2, refusal_share(rows), "solid", "%{y:.0%} refused"),
                (3, rows["ttft_p99_s"], "solid", "admitted p99 TTFT %{y:.3g} s"),
            )
            for index, (row, values, dash, hover) in enumerate(traces):
                fig.add_scatter(x=rows["load_multiple"], y=values, name=policy, legendgroup=policy,
                                showlegend=col == 1 and index == 0, mode="lines" if dash == "dot" else "lines+markers",
                                line={"color": colors[policy], "dash": dash}, hovertemplate=f"%{{x}}×: {hover}",
                                row=row, col=col)  # fmt: skip
        fig.add_hline(y=slo_ttft_s, line={"dash": "dash", "color": SLO_COLOR}, row=3, col=col)
    for row in (1, 2):
        fig.update_yaxes(tickformat=".0%", range=[-0.03, 1.05], row=row)
    fig.update_yaxes(type="log", dtick="D2", tickformat=".2~g", row=3)
    fig.update_yaxes(title_text="met the SLO", row=1, col=1)
    fig.update_yaxes(title_text="refused", row=2, col=1)
    fig.update_yaxes(title_text="admitted p99 TTFT, s", row=3, col=1)
    fig.update_xaxes(title_text="offered load, × capacity", row=3)
    title = title or "Overload, with and without admission"
    fig.update_layout(template=register_course_theme(), height=800, title=title,
                      legend={"orientation": "h", "yanchor": "top", "y": -0.08, "xanchor": "left", "x": 0},
                      margin={"b": 110})  # fmt: skip
    fig.add_annotation(text="solid: of the requests admitted · dotted: of all sent · dashed: the TTFT SLO",
                       xref="paper", yref="paper", x=1, y=-0.12, xanchor="right", showarrow=False)  # fmt: skip
    return fig


def storm_figure(
    storm: pd.DataFrame,
    spike_s: tuple[float, float],
    capacity_rps: float | None = None,
    users_rps: Sequence[tuple[float, float]] = (),
) -> go.Figure:
    """The retry storm, one line per strategy: attempts sent per second (the offered load, retries included)
    above, successes per second below, against time; the spike's seconds shaded, the capacity a dotted
    line, and ``users_rps`` ((seconds, requests/s) where the users' own rate changes) a dashed step."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("attempts sent per second (offered load)", "successes per second"))  # fmt: skip
    for index, (strategy, rows) in enumerate(storm.sort_values("t_s").groupby("strategy", sort=False)):
        style = {"mode": "lines", "line_shape": "hv", "legendgroup": strategy, "name": strategy,
                 "line_color": COLORWAY[index % len(COLORWAY)]}  # fmt: skip
        fig.add_scatter(x=rows["t_s"], y=rows["attempts_per_s"], **style, row=1, col=1)
        fig.add_scatter(x=rows["t_s"], y=rows["successes_per_s"], showlegend=False, **style, row=2, col=1)
    if users_rps:
        times, rates = zip(*users_rps)
        fig.add_scatter(x=times, y=rates, mode="lines", line_shape="hv", name="the users' own requests",
                        line={"dash": "dash", "color": "#000000"}, row=1, col=1)  # fmt: skip
    for row in (1, 2):
        fig.add_vrect(x0=spike_s[0], x1=spike_s[1], fillcolor=SLO_COLOR, opacity=0.12, line_width=0, row=row, col=1,
                      **_label("spike" if row == 1 else None, "top left"))  # fmt: skip
        if capacity_rps:
            fig.add_hline(y=capacity_rps, line={"dash": "dot", "color": "#666666"}, row=row, col=1,
                          **_label("capacity" if row == 1 else None, "top right"))  # fmt: skip
    fig.update_xaxes(title_text="seconds into the run", row=2, col=1)
    fig.update_yaxes(title_text="per second")
    fig.update_layout(template=register_course_theme(), height=600,
                      title="A retry storm: the same users, four ways to retry")  # fmt: skip
    return fig


def accounting_table(served: pd.DataFrame) -> pd.DataFrame:
    """Every request the client sent, by outcome, per policy and load: ``sent``, the :data:`OUTCOMES`,
    ``unaccounted`` (sent minus the outcomes: 0 when none was lost) and ``server_accounted`` (the
    server's ``/metrics`` counted the same)."""
    table = served.set_index(["policy", "load_multiple"])[["sent", *OUTCOMES, "server_accounted"]].copy()
    table.insert(len(OUTCOMES) + 1, "unaccounted", table["sent"] - table[list(OUTCOMES)].sum(axis=1))
    return table

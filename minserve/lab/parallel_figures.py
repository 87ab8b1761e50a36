"""Chapter 06's figures: each measurement beside its prediction. Nothing here measures; every function takes
the tables of :mod:`minserve.lab.parallel_runs`, :mod:`~minserve.lab.parallel_routing` and
:mod:`~minserve.lab.parallel_experts` and returns a plotly ``Figure``."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve.lab.parallel_experts import ExpertParallelRun
from minserve.lab.theme import COLORWAY, register_course_theme
from minserve.parallel.pipeline import PipelineStats

MEASURED, PREDICTED = COLORWAY[0], COLORWAY[1]


def traffic_figure(steps: pd.DataFrame, bytes_per_token: int, title: str = "") -> go.Figure:
    """Rank 0's all-reduce bytes in each step against the step's tokens, with the formula's line
    (``bytes_per_token`` × tokens: every token all-reduced ``2 × layers + 1`` times)."""
    most = int(steps["tokens"].max())
    fig = go.Figure()
    fig.add_scatter(x=[0, most], y=[0, most * bytes_per_token / 1e3], mode="lines", name="formula",
                    line={"color": PREDICTED, "dash": "dash"})  # fmt: skip
    fig.add_scatter(x=steps["tokens"], y=steps["all_reduce_bytes"] / 1e3, mode="markers", name="measured (a step)",
                    marker={"color": MEASURED, "size": 9}, customdata=steps["all_reduce_calls"],
                    hovertemplate="%{x} tokens: %{y:.1f} kB in %{customdata} all-reduces<extra></extra>")  # fmt: skip
    fig.update_layout(template=register_course_theme(), title=title, xaxis_title="tokens in the step",
                      yaxis_title="all-reduce kB, rank 0")  # fmt: skip
    return fig


def latency_figure(table: pd.DataFrame, title: str = "") -> go.Figure:
    """A decode step's time, measured and predicted, per run: the part spent in collectives stacked on the rest."""
    fig = go.Figure()
    for kind, color, step, comm in (
        ("measured", MEASURED, "step ms (measured)", "in collectives ms (measured)"),
        ("predicted", PREDICTED, "step ms (predicted)", "collectives ms (predicted)"),
    ):
        x = [[kind] * len(table), list(table.index)]
        fig.add_bar(x=x, y=table[step] - table[comm], name=f"{kind}: compute and the rest", marker_color=color)
        fig.add_bar(x=x, y=table[comm], name=f"{kind}: in collectives", marker_color=color,
                    marker_pattern_shape="/", marker_line_color="white")  # fmt: skip
    fig.update_layout(template=register_course_theme(), barmode="stack", title=title, yaxis_title="ms per decode step")
    return fig


def bubble_figure(table: pd.DataFrame, title: str = "") -> go.Figure:
    """The bubble against the number of micro-batches: measured (a bar per count) and ``(p − 1) / (m + p − 1)``."""
    fig = go.Figure()
    labels = [str(m) for m in table.index]
    fig.add_bar(x=labels, y=table["bubble (measured)"], name="measured", marker_color=MEASURED,
                text=[f"{b:.2f}" for b in table["bubble (measured)"]], textposition="outside")  # fmt: skip
    fig.add_scatter(x=labels, y=table["bubble (predicted)"], name="(p − 1) / (m + p − 1)", mode="lines+markers",
                    line={"color": PREDICTED, "dash": "dash"}, marker={"size": 10})  # fmt: skip
    fig.update_layout(template=register_course_theme(), title=title, xaxis_title="micro-batches in the step (m)",
                      yaxis_title="idle share of the stages' time", yaxis_range=[0, 1])  # fmt: skip
    return fig


def timeline_figure(stats: dict[int, PipelineStats], title: str = "") -> go.Figure:
    """One step of each micro-batch count as a timeline: a row per stage, a bar per micro-batch (ms from the
    step's start, each count on its own scale). The gaps are the bubble."""
    counts = list(stats)
    # Each its own time axis: a step of four micro-batches takes several times one of one.
    fig = make_subplots(rows=len(counts), cols=1, vertical_spacing=0.12, subplot_titles=[f"m = {m}" for m in counts])
    for row, m in enumerate(counts, start=1):
        step = stats[m].steps[-1]  # the last: warm, and like the others
        origin = min(start for stage in step.spans for start, _ in stage)
        for s, spans in enumerate(step.spans):
            for i, (start, end) in enumerate(spans):
                fig.add_bar(
                    x=[1e3 * (end - start)], base=[1e3 * (start - origin)], y=[f"stage {s}"], orientation="h",
                    marker_color=COLORWAY[i % len(COLORWAY)], showlegend=False, text=[f"{i + 1}"],
                    textposition="inside",
                    hovertemplate=f"stage {s}, micro-batch {i + 1}: %{{x:.2f}} ms<extra></extra>",
                    row=row, col=1,
                )  # fmt: skip
        fig.update_yaxes(autorange="reversed", row=row, col=1)
    fig.update_layout(template=register_course_theme(), title=title, barmode="overlay", height=160 + 140 * len(counts))
    fig.update_xaxes(title_text="ms from the step's start", row=len(counts), col=1)
    return fig


def routing_figure(table: pd.DataFrame, title: str = "") -> go.Figure:
    """Each policy's prefix-cache hit rate, measured (bars) and predicted from its placement (markers)."""
    fig = go.Figure()
    fig.add_bar(x=list(table.index), y=table["hit rate (measured)"], name="measured", marker_color=MEASURED,
                text=[f"{h:.0%}" for h in table["hit rate (measured)"]], textposition="outside")  # fmt: skip
    fig.add_scatter(x=list(table.index), y=table["hit rate (predicted)"], name="predicted from the placement",
                    mode="markers", marker={"color": PREDICTED, "size": 14, "symbol": "diamond"})  # fmt: skip
    fig.update_layout(template=register_course_theme(), title=title, yaxis_title="prompt tokens found cached",
                      yaxis_tickformat=".0%", yaxis_range=[0, 1])  # fmt: skip
    return fig


def expert_load_figure(run: ExpertParallelRun, title: str = "") -> go.Figure:
    """The (token, expert) pairs each rank's experts ran in each sparse layer, stacked, with the line every
    layer must reach: forwarded tokens × top-k."""
    load = run.load_per_rank
    layers = [f"layer {i}" for i in run.config.moe_layers]
    fig = go.Figure()
    for rank in range(run.world_size):  # the ranks' colours skip the prediction's
        first = rank * run.config.num_experts // run.world_size
        experts = f"experts {first}–{first + run.config.num_experts // run.world_size - 1}"
        fig.add_bar(x=layers, y=load[:, rank].tolist(), name=f"rank {rank} ({experts})",
                    marker_color=COLORWAY[(2 * rank) % len(COLORWAY)])  # fmt: skip
    expected = run.forwarded_tokens * run.config.num_experts_per_tok
    fig.add_hline(y=expected, line_dash="dash", line_color=PREDICTED,
                  annotation_text=f"tokens × top-k = {expected}")  # fmt: skip
    fig.update_layout(template=register_course_theme(), barmode="stack", title=title,
                      yaxis_title="(token, expert) pairs run")  # fmt: skip
    return fig

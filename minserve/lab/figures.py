"""Figures from minserve results: latency distributions with the contract's thresholds drawn on them.

Each function takes :class:`minserve.slo.RequestRecord` lists and returns a plotly ``Figure``; nothing is
shown or saved here, so a notebook cell ends with the call and the renderer does the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from minserve import slo
from minserve.lab.theme import SLO_COLOR, register_course_theme

METRIC_LABELS = {
    "ttft": "TTFT (ms)",
    "tpot": "TPOT (ms)",
    "itl": "inter-token latency (ms)",
    "e2e": "end-to-end latency (ms)",
    "max_itl": "longest stall (ms)",
}


def latency_ecdf(
    records: Sequence[slo.RequestRecord], metric: str = "ttft", slos: Sequence[slo.SLO] = (), title: str | None = None
) -> go.Figure:
    """ECDF of one metric in ms, one vertical line per SLO that sets a target for it.

    Read it as: the curve's height where it crosses a threshold line is the fraction of requests meeting
    that target; the p99 sits where the curve reaches 0.99.
    """
    values_ms = [v * 1e3 for v in slo.metric_values_s(records, metric)]
    xs, ys = slo.ecdf_points(values_ms)
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines+markers", line_shape="hv", name="measured"))
    fig.add_hline(y=0.99, line_dash="dot", line_color="gray", annotation_text="p99", annotation_position="left")
    _add_slo_lines(fig, metric, slos)
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"{METRIC_LABELS[metric]}: empirical CDF over {len(values_ms)} samples",
        xaxis_title=METRIC_LABELS[metric],
        yaxis_title="fraction of requests ≤ x",
        yaxis_range=[0, 1.05],
    )
    return fig


def latency_histogram(
    records: Sequence[slo.RequestRecord],
    metric: str = "itl",
    slos: Sequence[slo.SLO] = (),
    bins: int = 40,
    title: str | None = None,
) -> go.Figure:
    """Histogram of one metric in ms, with the p50 and p99 and each SLO's target drawn as lines."""
    values_ms = [v * 1e3 for v in slo.metric_values_s(records, metric)]
    fig = go.Figure(go.Histogram(x=values_ms, nbinsx=bins, name="measured"))
    for q in (50, 99):
        if values_ms:
            fig.add_vline(x=slo.percentile(values_ms, q), line_dash="dot", line_color="gray", annotation_text=f"p{q}")
    _add_slo_lines(fig, metric, slos)
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"{METRIC_LABELS[metric]}: {len(values_ms)} samples",
        xaxis_title=METRIC_LABELS[metric],
        yaxis_title="count",
        bargap=0.05,
    )
    return fig


def _add_slo_lines(fig: go.Figure, metric: str, slos: Sequence[slo.SLO]) -> None:
    # TPOT bounds the average gap, so a TPOT target is the natural line on an ITL histogram too.
    key = "tpot" if metric == "itl" else metric
    for target in slos:
        bound_s = target.targets().get(key)
        if bound_s is not None:
            fig.add_vline(
                x=bound_s * 1e3,
                line_color=SLO_COLOR,
                line_dash="dash",
                annotation_text=f"{target.name}: {bound_s * 1e3:g} ms",
                annotation_position="top right",
            )

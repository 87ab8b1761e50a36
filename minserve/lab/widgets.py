"""Widgets: move the SLO thresholds, watch attainment and goodput follow.

The arithmetic is in plain functions (:func:`attainment_for_thresholds`, :func:`slider_range_ms`,
:func:`summary_html`) that tests call directly; the widget only wires sliders to them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ipywidgets as widgets

from minserve import slo


def attainment_for_thresholds(
    records: Sequence[slo.RequestRecord], ttft_ms: float, tpot_ms: float, window: float | None = None
) -> dict[str, float]:
    """Attainment (fractions) and goodput/throughput (requests/s) for a TTFT and a TPOT threshold in ms.

    Keys: ``ttft``, ``tpot``, ``all`` (fractions of all requests), ``goodput_rps``, ``request_throughput_rps``.
    Invariants: raising a threshold never lowers any attainment; ``goodput_rps ≤ request_throughput_rps``.
    """
    target = slo.SLO(name="explorer", ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3)
    return slo.attainment(records, target) | {
        "goodput_rps": slo.goodput_rps(records, target, window),
        "request_throughput_rps": slo.request_throughput_rps(records, window),
    }


def slider_range_ms(values_s: Sequence[float], headroom: float = 1.5) -> tuple[float, float, float]:
    """(min, max, step) in ms for a threshold slider: one step up to ``headroom`` × the largest value.

    About 100 round steps. The minimum is one step, not 0: an SLO bound must be positive, so a slider
    dragged to its left end still names a contract.
    """
    top_ms = max(values_s, default=0.0) * 1e3 * headroom
    top_ms = top_ms if top_ms > 0 else 1.0  # a slider needs a non-empty range even with no data
    step = 10.0 ** math.floor(math.log10(top_ms / 100))  # a round step, about a hundredth of the range
    return step, float(math.ceil(top_ms / step) * step), step


def summary_html(result: dict[str, float]) -> str:
    """The explorer's readout as a small HTML table (percentages and requests/s)."""
    cells = [
        ("TTFT met", f"{result['ttft']:.0%}"),
        ("TPOT met", f"{result['tpot']:.0%}"),
        ("both met", f"{result['all']:.0%}"),
        ("goodput", f"{result['goodput_rps']:.2f} req/s"),
        ("throughput", f"{result['request_throughput_rps']:.2f} req/s"),
    ]
    header = "".join(f"<th style='padding:0 12px'>{name}</th>" for name, _ in cells)
    values = "".join(f"<td style='padding:0 12px;text-align:center'>{value}</td>" for _, value in cells)
    return f"<table><tr>{header}</tr><tr>{values}</tr></table>"


def slo_explorer(
    records: Sequence[slo.RequestRecord], ttft_ms: float = 500.0, tpot_ms: float = 100.0, window: float | None = None
) -> widgets.VBox:
    """Two sliders (TTFT and TPOT thresholds, ms) above a readout of attainment and goodput."""
    records = list(records)

    def slider(metric: str, value_ms: float) -> widgets.FloatSlider:
        low, high, step = slider_range_ms(slo.metric_values_s(records, metric))
        return widgets.FloatSlider(
            value=min(value_ms, high),
            min=low,
            max=high,
            step=step,
            description=f"{metric.upper()} ms",
            continuous_update=True,
            layout=widgets.Layout(width="480px"),
        )

    ttft, tpot = slider("ttft", ttft_ms), slider("tpot", tpot_ms)
    readout = widgets.HTML()

    def update(_change: object = None) -> None:
        readout.value = summary_html(attainment_for_thresholds(records, ttft.value, tpot.value, window))

    ttft.observe(update, names="value")
    tpot.observe(update, names="value")
    update()
    return widgets.VBox([ttft, tpot, readout])

"""Chapter 09's capacity planner: SLO attainment against the arrival rate with its knee, the envelope as a
table, and the widget on it (target rate, lengths, SLO → replicas and cost).

The numbers come from :mod:`minserve.capacity.planner` (what ``minserve plan capacity`` prints):
:func:`attainment_curve` simulates a sweep of rates into a DataFrame, :func:`attainment_figure` draws it with
the knee (and, when given, the engine's measured attainment from
:func:`minserve.capacity.confirmation.confirm_on_engine` on it), :func:`plan_table` is the widget's whole
callback, and :func:`capacity_planner` only wires controls to it. Rates are requests per second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import slo
from minserve.capacity import planner
from minserve.capacity.confirmation import EngineCheck
from minserve.capacity.envelope import Envelope, plan_capacity, slo_text
from minserve.capacity.planner import Machine, Workload
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme
from minserve.workload import LengthDist

TARGET_COLORS = {"ttft": COLORWAY[1], "tpot": COLORWAY[2], "e2e": COLORWAY[4], "max_itl": COLORWAY[5]}


# --- the curve and its figure --------------------------------------------------------------------------------


def attainment_curve(
    machine: Machine,
    workload: Workload,
    slo_target: slo.SLO,
    rates_rps: Sequence[float],
    required_attainment: float = 0.99,
) -> pd.DataFrame:
    """One simulated run per rate (:func:`minserve.capacity.planner.probe_rate`, the same requests at every
    rate). Columns: ``rate_rps``, ``attainment_<target>`` for each target of the SLO and ``attainment_all``
    (fractions of all requests), ``meets_slo``, ``goodput_rps``, ``ttft_ms`` and ``tpot_ms`` (at the SLO's
    percentile), ``output_tokens_per_s``, ``queue_found`` (requests). Invariant: ``attainment_all`` ≤ each
    single target's."""
    rows = []
    for rate in rates_rps:
        probe = planner.probe_rate(machine, workload, slo_target, required_attainment, rate)
        rows.append(
            {
                "rate_rps": rate,
                **{f"attainment_{key}": value for key, value in probe.attainment.items()},
                "meets_slo": probe.meets_slo,
                "goodput_rps": probe.goodput_rps,
                "ttft_ms": probe.ttft_ms,
                "tpot_ms": probe.tpot_ms,
                "output_tokens_per_s": probe.output_tokens_per_s,
                "queue_found": probe.queue_found_requests,
            }
        )
    return pd.DataFrame(rows)


def curve_rates(envelope: Envelope, points: int = 12, top_share: float = 1.3) -> list[float]:
    """``points`` rates from a tenth of the throughput ceiling to ``top_share`` of it, the knee among them."""
    ceiling = envelope.throughput.requests_per_s
    rates = set(np.linspace(0.1, top_share, points) * ceiling)
    if envelope.max_rate_rps > 0:
        rates.add(envelope.max_rate_rps)
    return sorted(float(rate) for rate in rates)


def envelope_curve(envelope: Envelope, points: int = 12) -> pd.DataFrame:
    """:func:`attainment_curve` of an envelope's machine, workload and SLO over :func:`curve_rates`."""
    return attainment_curve(envelope.machine, envelope.workload, envelope.slo_target, curve_rates(envelope, points),
                            envelope.required_attainment)  # fmt: skip


def attainment_figure(
    curve: pd.DataFrame,
    knee_rps: float,
    required_attainment: float,
    ceiling_rps: float | None = None,
    measured: Sequence[EngineCheck] = (),
    title: str = "",
) -> go.Figure:
    """Left: attainment of each target and of all together against the arrival rate, the required attainment
    as a horizontal line, the knee (the highest rate meeting the SLO) and the throughput ceiling as vertical
    ones, and the engine's measured attainment as diamonds. Right: goodput against the offered rate, beside
    the line where every request would be good."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("SLO attainment", "goodput"))
    for column in [c for c in curve.columns if c.startswith("attainment_")]:
        key = column.removeprefix("attainment_")
        every = key == "all"
        fig.add_trace(
            go.Scatter(
                x=curve["rate_rps"],
                y=curve[column],
                mode="lines+markers",
                name="all targets" if every else key.upper(),
                line={"color": COLORWAY[0] if every else TARGET_COLORS.get(key), "width": 3 if every else 1.5},
                hovertemplate="%{x:.3g} req/s: %{y:.1%}<extra></extra>",
            ),
            row=1,
            col=1,
        )  # fmt: skip
    if measured:
        fig.add_trace(
            go.Scatter(
                x=[c.rate_rps for c in measured],
                y=[c.measured.attainment["all"] for c in measured],
                mode="markers",
                name="engine, measured",
                marker={"symbol": "diamond", "size": 13, "color": COLORWAY[7]},
                hovertemplate="%{x:.3g} req/s: %{y:.1%} measured<extra></extra>",
            ),
            row=1,
            col=1,
        )
    fig.add_hline(y=required_attainment, line={"dash": "dash", "color": SLO_COLOR}, row=1, col=1,
                  annotation_text=f"required {required_attainment:.0%}", annotation_position="bottom left")  # fmt: skip
    top = max(curve["rate_rps"].max(), knee_rps)
    fig.add_trace(
        go.Scatter(x=curve["rate_rps"], y=curve["goodput_rps"], mode="lines+markers", name="goodput",
                   line={"color": COLORWAY[0]}, hovertemplate="%{x:.3g} req/s offered: %{y:.3g} good<extra></extra>"),
        row=1,
        col=2,
    )  # fmt: skip
    fig.add_trace(
        go.Scatter(x=[0, top], y=[0, top], mode="lines", name="every request good",
                   line={"dash": "dot", "color": "#999999"}, hoverinfo="skip"),
        row=1,
        col=2,
    )  # fmt: skip
    for col in (1, 2):  # labelled on the left only: plotly writes "new text" on a line whose label is None
        if knee_rps > 0:
            label = {"annotation_text": f"knee {knee_rps:.3g}/s"} if col == 1 else {}
            fig.add_vline(x=knee_rps, line={"dash": "dash", "color": SLO_COLOR}, row=1, col=col, **label)
        if ceiling_rps:
            label = {"annotation_text": "ceiling", "annotation_position": "top left"} if col == 1 else {}
            fig.add_vline(x=ceiling_rps, line={"dash": "dot", "color": "#666666"}, row=1, col=col, **label)
    legend_below = {"orientation": "h", "yanchor": "top", "y": -0.15, "xanchor": "left", "x": 0}  # a long title
    fig.update_layout(template=register_course_theme(), title=title, margin={"b": 110}, legend=legend_below)
    fig.update_xaxes(title_text="arrival rate, requests/s")
    fig.update_yaxes(title_text="share of requests", tickformat=".0%", range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="good requests/s", row=1, col=2)
    return fig


def envelope_figure(envelope: Envelope, curve: pd.DataFrame, measured: Sequence[EngineCheck] = ()) -> go.Figure:
    """:func:`attainment_figure` of an envelope: its knee, ceiling, required attainment and title."""
    title = f"{envelope.machine.name}: {slo_text(envelope.slo_target)}"
    return attainment_figure(curve, envelope.max_rate_rps, envelope.required_attainment,
                             envelope.throughput.requests_per_s, measured, title)  # fmt: skip


def save_attainment_chart(envelope: Envelope, path: str | Path, points: int = 12) -> Path:
    """``minserve plan capacity --plot``: the envelope's curve and figure as one self-contained HTML file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    envelope_figure(envelope, envelope_curve(envelope, points)).write_html(path, include_plotlyjs=True)
    return path


def confirmation_table(checks: Sequence[EngineCheck]) -> pd.DataFrame:
    """The engine's measurements beside the simulator's predictions, one row per rate
    (:meth:`~minserve.capacity.confirmation.EngineCheck.as_row`)."""
    return pd.DataFrame([check.as_row() for check in checks]).set_index("rate_rps")


# --- the widget ----------------------------------------------------------------------------------------------


def with_means(workload: Workload, prompt_mean_tokens: float, output_mean_tokens: float) -> Workload:
    """The workload with other mean lengths, each distribution's spread scaled with its mean (the same shape)."""

    def rescale(dist: LengthDist, mean: float) -> LengthDist:
        return dataclasses.replace(dist, mean=mean, spread=dist.spread * mean / dist.mean)

    return dataclasses.replace(workload, prompt_len=rescale(workload.prompt_len, prompt_mean_tokens),
                               output_len=rescale(workload.output_len, output_mean_tokens))  # fmt: skip


def plan_table(
    machine: Machine,
    workload: Workload,
    target_rate_rps: float,
    prompt_mean_tokens: float,
    output_mean_tokens: float,
    ttft_ms: float,
    tpot_ms: float,
    usd_per_replica_hour: float | None = None,
    required_attainment: float = 0.99,
) -> pd.DataFrame:
    """The widget's whole callback: the envelope of ``machine`` for the workload at these mean lengths under
    TTFT ≤ ``ttft_ms`` and TPOT ≤ ``tpot_ms``, with the replicas (and cost) of ``target_rate_rps``: a table
    indexed by quantity, columns ``value`` and ``how``, the envelope's notes last."""
    target = slo.SLO("planner", ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3)
    envelope = plan_capacity(machine, with_means(workload, prompt_mean_tokens, output_mean_tokens), target,
                                     required_attainment, target_rate_rps, usd_per_replica_hour)  # fmt: skip
    notes = [{"quantity": "note", "value": note, "how": ""} for note in envelope.notes]
    return pd.DataFrame([*envelope.rows(), *notes]).set_index("quantity")


def capacity_planner(
    machine: Machine,
    workload: Workload,
    target_rate_rps: float = 10.0,
    ttft_ms: float = 500.0,
    tpot_ms: float = 100.0,
    usd_per_replica_hour: float = 2.5,
    required_attainment: float = 0.99,
) -> widgets.VBox:
    """Target rate, mean prompt and output lengths, TTFT and TPOT bounds and the price of a replica above the
    envelope's table (:func:`plan_table`): the replicas and the cost follow. Each change re-runs the search
    (a few simulations), so the sliders update when released."""
    rate = widgets.FloatText(value=target_rate_rps, description="target req/s")
    prompt = widgets.IntSlider(value=round(workload.prompt_len.mean), min=8, max=4 * round(workload.prompt_len.mean),
                               description="prompt tokens", continuous_update=False)  # fmt: skip
    output = widgets.IntSlider(value=round(workload.output_len.mean), min=2, max=4 * round(workload.output_len.mean),
                               description="output tokens", continuous_update=False)  # fmt: skip
    ttft = widgets.FloatText(value=ttft_ms, description="TTFT ms")
    tpot = widgets.FloatText(value=tpot_ms, description="TPOT ms")
    price = widgets.FloatText(value=usd_per_replica_hour, description="$ / hour")
    readout = widgets.HTML()
    controls = [rate, prompt, output, ttft, tpot, price]

    def update(_change: object = None) -> None:
        try:
            table = plan_table(machine, workload, rate.value, prompt.value, output.value, ttft.value, tpot.value,
                               price.value, required_attainment)  # fmt: skip
        except ValueError as error:  # a bound or a rate the planner refuses: say what to change
            readout.value = f"<p style='color:{SLO_COLOR}'>{error}</p>"
            return
        readout.value = table.to_html(border=0)

    for control in controls:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls, readout])

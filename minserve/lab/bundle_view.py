"""Chapter 10's bundle explorer: a saved evidence bundle read back, one run's latency drawn against
SLO thresholds the reader moves, attainment and goodput following.

:func:`explore_run` is the widget's whole callback as a plain function (tests call it directly);
:func:`bundle_explorer` only wires controls to it. Thresholds are in ms.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import display

from minserve import slo
from minserve.bench import bundle
from minserve.bench.rows import rows_to_records
from minserve.lab.figures import latency_ecdf, latency_histogram
from minserve.lab.widgets import attainment_for_thresholds, slider_range_ms, summary_html

EXPLORER_METRICS: dict[str, str] = {"TTFT": "ttft", "TPOT": "tpot", "inter-token latency": "itl", "E2E": "e2e"}


@dataclasses.dataclass
class Bundle:
    """An evidence bundle read back from its directory: rows by run, summaries by run label."""

    path: Path
    groups: dict[str, list[dict[str, Any]]]
    summaries: dict[str, dict[str, Any]]
    document: dict[str, Any]

    @property
    def runs(self) -> list[str]:
        return list(self.groups)

    def duration_s(self, run: str) -> float:
        """The run's wall time as the summary states it; else its last end (each run's clock starts at 0)."""
        summary = self.summaries.get(run, {})
        if summary.get("duration_s") is not None:
            return float(summary["duration_s"])
        return max((row["end_s"] for row in self.groups.get(run, [])), default=0.0)


def load_bundle(out_dir: str | Path) -> Bundle:
    """Read ``records.jsonl`` and ``summary.json`` from a directory :meth:`BenchmarkResult.save` wrote."""
    path = Path(out_dir)
    document = json.loads((path / "summary.json").read_text())
    groups = bundle.rows_by_run(bundle.read_records(path / "records.jsonl"))
    return Bundle(path, groups, {s["label"]: s for s in document.get("runs", [])}, document)


def attainment_from_rows(
    rows: Sequence[Mapping[str, Any]], ttft_ms: float, tpot_ms: float, duration_s: float | None = None
) -> dict[str, float]:
    """Attainment and goodput for a TTFT and a TPOT threshold (ms), recomputed from raw rows.

    The same arithmetic as the explorer of chapter 01 (:func:`minserve.lab.attainment_for_thresholds`), on
    the records the load tester's own summary was computed from; ``duration_s`` is the run's wall time.
    Thresholds must be positive.
    """
    return attainment_for_thresholds(rows_to_records(rows), ttft_ms, tpot_ms, duration_s)


def explore_run(
    data: Bundle, run: str, metric: str = "ttft", kind: str = "CDF", ttft_ms: float = 250.0, tpot_ms: float = 60.0
) -> tuple[go.Figure, str]:
    """The explorer's whole callback: one run's ``metric`` as a CDF or histogram with the thresholds drawn, and
    an HTML readout of attainment and goodput at those thresholds beside the summary's own numbers."""
    rows = data.groups[run]
    records = rows_to_records(rows)
    contract = slo.SLO(name="explorer", ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3)
    title = f"{run}: {metric.upper()}"
    figure = (
        latency_ecdf(records, metric, [contract], title=title)
        if kind == "CDF"
        else latency_histogram(records, metric, [contract], title=title)
    )
    result = attainment_from_rows(rows, ttft_ms, tpot_ms, data.duration_s(run))
    summary = data.summaries.get(run, {})
    statuses = {status: sum(row["status"] == status for row in rows) for status in slo.STATUSES}
    counts = ", ".join(f"{n} {status}" for status, n in statuses.items())
    saved = summary.get("goodput_rps")
    note = f"<p>{len(rows)} requests ({counts}) over {data.duration_s(run):.2f} s. " + (
        f"The bundle's own goodput, at its contract: {saved:.2f} req/s.</p>" if saved is not None else "</p>"
    )
    return figure, summary_html(result) + note


def bundle_explorer(out_dir: str | Path, ttft_ms: float = 250.0, tpot_ms: float = 60.0) -> widgets.VBox:
    """Pick a run and a metric, CDF or histogram; move the SLO sliders: attainment and goodput follow."""
    data = load_bundle(out_dir)
    all_rows = [row for rows in data.groups.values() for row in rows]
    all_records = rows_to_records(all_rows)
    run = widgets.Dropdown(options=data.runs, value=data.runs[0] if data.runs else None, description="run")
    metric = widgets.Dropdown(options=list(EXPLORER_METRICS.items()), value="ttft", description="metric")
    kind = widgets.ToggleButtons(options=["CDF", "histogram"], value="CDF")

    def slider(name: str, value_ms: float) -> widgets.FloatSlider:
        low, high, step = slider_range_ms(slo.metric_values_s(all_records, name))
        # From one step, not 0: a threshold of 0 ms is no contract (slo.SLO refuses it).
        return widgets.FloatSlider(value=min(value_ms, high), min=low, max=high, step=step,
                                   description=f"{name.upper()} ms", continuous_update=False,
                                   layout=widgets.Layout(width="480px"))  # fmt: skip

    ttft, tpot = slider("ttft", ttft_ms), slider("tpot", tpot_ms)
    plot, readout = widgets.Output(), widgets.HTML()

    def update(_change: object = None) -> None:
        if run.value is None:
            readout.value = "<p>This bundle holds no runs.</p>"
            return
        figure, html = explore_run(data, run.value, metric.value, kind.value, ttft.value, tpot.value)
        readout.value = html
        with plot:
            plot.clear_output(wait=True)
            display(figure)

    for control in (run, metric, kind, ttft, tpot):
        control.observe(update, names="value")
    update()
    return widgets.VBox([widgets.HBox([run, metric, kind]), ttft, tpot, readout, plot])

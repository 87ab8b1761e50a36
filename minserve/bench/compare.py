"""Two or more evidence bundles side by side: the comparison a reader of a load test wants to make.

``minserve bench compare A B`` reads what two ``minserve bench serve`` runs left (``summary.json`` and
``records.jsonl``, never memory) and shows them against each other: for every run label both hold (the same
rate or concurrency), throughput, goodput and the tail latencies with the ratio of each to the first bundle,
and one page with the sweeps overlaid and each shared run's latency CDFs. The runs are only comparable if
they sent the same workload, so the workload each recorded is shown too, and a difference is flagged.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from minserve import slo
from minserve.bench.bundle import PAGE, TEMPLATE, color, figure_html, html_table, latencies_ms, read_records, section
from minserve.bench.report import cell_text
from minserve.slo import lookup

# (header, key in a run summary, whether a larger value is better)
COMPARED: tuple[tuple[str, str, bool], ...] = (
    ("req/s", "request_throughput_rps", True),
    ("tok/s", "output_throughput_tps", True),
    ("good/s", "goodput_rps", True),
    ("TTFT p50", "ttft_ms.p50", False),
    ("TTFT p99", "ttft_ms.p99", False),
    ("TPOT p50", "tpot_ms.p50", False),
    ("TPOT p99", "tpot_ms.p99", False),
)


@dataclass(frozen=True)
class Bundle:
    """One run directory: a name to show, its summaries by run label, its records and its workload."""

    name: str
    summaries: dict[str, dict[str, Any]]
    rows: list[dict[str, Any]]
    workload: dict[str, Any]


def load_bundle(directory: Path, name: str | None = None) -> Bundle:
    """Read a directory ``minserve bench serve`` wrote; named by ``name``, else by the server it measured."""
    directory = Path(directory)
    for needed in ("summary.json", "records.jsonl"):
        if not (directory / needed).is_file():
            raise FileNotFoundError(f"{directory} has no {needed}: is it a `minserve bench serve --out` directory?")
    document = json.loads((directory / "summary.json").read_text())
    config = document.get("config", {})
    base_url = config.get("options", {}).get("base_url")
    default_name = f"{directory.name} ({base_url})" if base_url else directory.name
    return Bundle(
        name=name or default_name,
        summaries={s["label"]: s for s in document.get("runs", [])},
        rows=read_records(directory / "records.jsonl"),
        workload=config.get("workload", {}),
    )


def shared_labels(bundles: list[Bundle]) -> list[str]:
    """The run labels every bundle holds, in the first bundle's order."""
    return [label for label in bundles[0].summaries if all(label in b.summaries for b in bundles[1:])]


def comparison_rows(bundles: list[Bundle]) -> list[dict[str, Any]]:
    """One row per shared run label and bundle: the compared numbers and, for every bundle after the first,
    each number's ratio to the first bundle's (``×`` in the key). A ratio above 1 is more of the quantity,
    whichever way is better; ``better`` says for how many of the numbers this bundle beat the first."""
    rows = []
    for label in shared_labels(bundles):
        base = bundles[0].summaries[label]
        for bundle in bundles:
            summary = bundle.summaries[label]
            row: dict[str, Any] = {"run": label, "bundle": bundle.name}
            wins = 0
            for header, key, larger_is_better in COMPARED:
                value, reference = lookup(summary, key), lookup(base, key)
                row[header] = value
                if bundle is not bundles[0] and value is not None and reference:
                    row[f"{header} ×"] = value / reference
                    wins += (value > reference) == larger_is_better and value != reference
            if bundle is not bundles[0]:
                row["better"] = f"{wins}/{len(COMPARED)}"
            rows.append(row)
    return rows


def format_comparison(bundles: list[Bundle]) -> str:
    """The comparison as a text table, for the terminal."""
    lines = [f"{'run':<16}{'bundle':<40}" + "".join(f"{h:>16}" for h, _, _ in COMPARED)]
    for row in comparison_rows(bundles):
        cells = []
        for header, _, _ in COMPARED:
            ratio = row.get(f"{header} ×")
            text = cell_text(row[header]) + (f" ({ratio:.2f}×)" if ratio is not None else "")
            cells.append(f"{text:>16}")
        lines.append(f"{row['run']:<16}{row['bundle'][:39]:<40}" + "".join(cells))
    differing = [b.name for b in bundles[1:] if b.workload != bundles[0].workload]
    if differing:
        lines.append(f"warning: {', '.join(differing)} sent another workload than {bundles[0].name}")
    return "\n".join(lines)


def sweeps_figure(bundles: list[Bundle]) -> go.Figure:
    """Each bundle's throughput–latency curve (TTFT p99 and TPOT p50 against output tokens/s), overlaid."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["TTFT p99 (ms)", "TPOT p50 (ms)"])
    for index, bundle in enumerate(bundles):
        summaries = list(bundle.summaries.values())
        for col, key in enumerate(("ttft_ms.p99", "tpot_ms.p50"), start=1):
            fig.add_scatter(
                x=[s["output_throughput_tps"] for s in summaries], y=[lookup(s, key) for s in summaries],
                mode="lines+markers+text", text=[s["label"] for s in summaries], textposition="top center",
                line_color=color(index), name=bundle.name, legendgroup=bundle.name, showlegend=col == 1,
                row=1, col=col,
            )  # fmt: skip
    fig.update_xaxes(title_text="output tokens/s achieved")
    fig.update_layout(template=TEMPLATE, height=440, title="Throughput against latency, each server")
    return fig


def cdf_figure(bundles: list[Bundle], label: str) -> go.Figure:
    """TTFT and TPOT CDFs of one shared run label, one line per bundle."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["TTFT (ms)", "TPOT (ms)"])
    for index, bundle in enumerate(bundles):
        rows = [row for row in bundle.rows if row["run"] == label]
        for col, metric in enumerate(("ttft_ms", "tpot_ms"), start=1):
            xs, ys = slo.ecdf_points(latencies_ms(rows, metric))
            fig.add_scatter(x=xs, y=ys, mode="lines", line_shape="hv", line_color=color(index), name=bundle.name,
                            legendgroup=bundle.name, showlegend=col == 1, row=1, col=col)  # fmt: skip
    fig.update_yaxes(title_text="fraction ≤ x", range=[0, 1.02])
    fig.update_layout(template=TEMPLATE, height=380, title=f"Latency CDFs at {label}")
    return fig


def build_comparison_html(bundles: list[Bundle]) -> str:
    """The comparison page: the table, the overlaid sweeps, each shared run's CDFs, and the workloads."""
    header = ["run", "bundle", *(h for h, _, _ in COMPARED), "better"]
    table_rows = [
        [html.escape(r["run"]), html.escape(r["bundle"])]
        + [cell_text(r[h]) + (f" ({r[h + ' ×']:.2f}×)" if f"{h} ×" in r else "") for h, _, _ in COMPARED]
        + [r.get("better", "")]
        for r in comparison_rows(bundles)
    ]
    note = f"<p>Ratios are to {html.escape(bundles[0].name)}. Latencies in ms, throughput per second.</p>"
    sections = [section("Side by side", note + html_table(header, table_rows, "numbers"))]
    if max(len(b.summaries) for b in bundles) > 1:
        sections.append(section("Sweeps", figure_html(sweeps_figure(bundles))))
    sections += [section(f"At {label}", figure_html(cdf_figure(bundles, label))) for label in shared_labels(bundles)]
    workloads = [[html.escape(b.name), f"<pre>{html.escape(json.dumps(b.workload, indent=1))}</pre>"] for b in bundles]
    sections.append(section("Workloads", html_table(["bundle", "workload"], workloads)))
    title = "minserve bench compare · " + " vs ".join(html.escape(b.name) for b in bundles)
    return PAGE.format(title=title, plotly_js=get_plotlyjs(), body="\n".join(sections))


def write_comparison(directories: list[Path], out: Path) -> tuple[list[Bundle], Path]:
    """Load the bundles, refuse a comparison with nothing in common, and write the page to ``out``."""
    if len(directories) < 2:
        raise ValueError("compare needs at least two run directories")
    bundles = [load_bundle(d) for d in directories]
    if not shared_labels(bundles):
        labels = {b.name: list(b.summaries) for b in bundles}
        raise ValueError(f"the bundles share no run label (the same rate or concurrency): {labels}")
    out = Path(out)
    out.write_text(build_comparison_html(bundles))
    return bundles, out

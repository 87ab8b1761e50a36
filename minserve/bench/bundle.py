"""The evidence bundle: one HTML file that shows what a load test found, and opens with no internet.

A benchmark's number is only as good as the evidence behind it. The bundle puts on one page what a
reviewer needs to trust (or doubt) a run: the verdict against the SLO, the configuration and the
environment it ran in (including the git commit), latency distributions and CDFs, the throughput–latency
curve of a sweep, errors by kind, the client's own overhead, the server's own counters, the cost, and a
link to the raw per-request records every number can be recomputed from.

It is built from the files a run leaves (``summary.json`` and ``records.jsonl``), never from memory, so
``minserve bench report DIR`` rebuilds it from the raw data alone. plotly.js is inlined once, so the file is
self-contained (about 5 MB).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from minserve import slo
from minserve.bench.report import TABLE_COLUMNS, cell_text
from minserve.slo import lookup

BUNDLE_NAME = "report.html"
METRICS_MS: tuple[tuple[str, str], ...] = (
    ("ttft_ms", "TTFT (ms)"),
    ("tpot_ms", "TPOT (ms)"),
    ("itl_ms", "inter-token latency (ms)"),
    ("e2e_ms", "end-to-end latency (ms)"),
)
TEMPLATE = "plotly_white"


# --- data from the raw records ----------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``records.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def latencies_ms(rows: Iterable[dict[str, Any]], metric: str) -> list[float]:
    """One metric of the ok requests, in ms; ``itl_ms`` pools every gap between content chunks."""
    ok = [row for row in rows if row["status"] == "ok"]
    if metric == "itl_ms":
        return [gap * 1e3 for row in ok for gap in slo.itl_s(row["chunk_times_s"])]
    return [row[metric] for row in ok if row.get(metric) is not None]


def rows_by_run(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by their run label, in the order the runs appear."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["run"], []).append(row)
    return groups


# --- figures ----------------------------------------------------------------------------------------------


def cdf_figure(groups: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E, one line per run. The p99 is where a line reaches 0.99."""
    fig = make_subplots(rows=2, cols=2, subplot_titles=[label for _, label in METRICS_MS])
    for run_index, (run, rows) in enumerate(groups.items()):
        for position, (metric, label) in enumerate(METRICS_MS):
            xs, ys = slo.ecdf_points(latencies_ms(rows, metric))
            trace = go.Scatter(
                x=xs, y=ys, mode="lines", line_shape="hv", name=run, legendgroup=run, showlegend=position == 0
            )
            fig.add_trace(trace.update(line_color=color(run_index)), row=position // 2 + 1, col=position % 2 + 1)
            fig.update_xaxes(title_text=label, row=position // 2 + 1, col=position % 2 + 1)
    fig.update_yaxes(title_text="fraction ≤ x", range=[0, 1.02])
    fig.update_layout(template=TEMPLATE, height=640, title="Latency CDFs (ok requests)")
    return fig


def distribution_figure(groups: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """Box plots of the same four metrics, one box per run: the spread and the outliers at a glance."""
    fig = make_subplots(rows=1, cols=4, subplot_titles=[label for _, label in METRICS_MS])
    for run_index, (run, rows) in enumerate(groups.items()):
        for position, (metric, _) in enumerate(METRICS_MS):
            box = go.Box(y=latencies_ms(rows, metric), name=run, marker_color=color(run_index), showlegend=False)
            fig.add_trace(box, row=1, col=position + 1)
    fig.update_layout(template=TEMPLATE, height=420, title="Latency distributions (ms)")
    return fig


def timeline_figure(groups: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """Every request's E2E latency against when it was sent: a queue building up shows as a rising line."""
    fig = go.Figure()
    for run_index, (run, rows) in enumerate(groups.items()):
        for status, symbol in (("ok", "circle"), ("cancelled", "x"), ("failed", "diamond")):
            chosen = [row for row in rows if row["status"] == status]
            if chosen:
                fig.add_scatter(
                    x=[row["sent_s"] for row in chosen],
                    y=[(row["end_s"] - row["sent_s"]) * 1e3 for row in chosen],
                    mode="markers",
                    marker={"symbol": symbol, "color": color(run_index), "size": 6},
                    name=f"{run} · {status}",
                )
    fig.update_layout(
        template=TEMPLATE, height=420, title="Each request over the run", xaxis_title="sent at (s into the run)",
        yaxis_title="send → last byte (ms)",
    )  # fmt: skip
    return fig


def sweep_figure(summaries: Sequence[dict[str, Any]]) -> go.Figure:
    """The throughput–latency curve of a sweep: p50 and p99 TTFT and TPOT against output tokens/s achieved.

    Where the curve turns up steeply is the knee: past it, more load buys little throughput and a lot of
    latency.
    """
    fig = make_subplots(rows=1, cols=2, subplot_titles=["TTFT (ms)", "TPOT (ms)"])
    throughput = [s["output_throughput_tps"] for s in summaries]
    labels = [s["label"] for s in summaries]
    for col, metric in enumerate(("ttft_ms", "tpot_ms"), start=1):
        for q, dash in (("p50", "solid"), ("p99", "dash")):
            fig.add_scatter(
                x=throughput,
                y=[lookup(s, f"{metric}.{q}") for s in summaries],
                mode="lines+markers+text",
                text=labels if q == "p99" else None,
                textposition="top center",
                line_dash=dash,
                line_color=color(0 if q == "p50" else 1),
                name=q,
                showlegend=col == 1,
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="output tokens/s achieved")
    fig.update_layout(template=TEMPLATE, height=440, title="Throughput against latency across the sweep")
    return fig


def color(index: int) -> str:
    palette = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
    return palette[index % len(palette)]


# --- the page ---------------------------------------------------------------------------------------------


def build_html(document: dict[str, Any], rows: Sequence[dict[str, Any]], records_href: str = "records.jsonl") -> str:
    """The whole bundle as one HTML string, from a ``summary.json`` document and the records' rows."""
    config, summaries = document.get("config", {}), document.get("runs", [])
    groups = rows_by_run(rows)
    sections = [
        section("Verdict", _verdict_table(summaries)),
        section("Results", _summary_table(summaries) + _errors_table(summaries)),
        section("Latency", figure_html(cdf_figure(groups)) + figure_html(distribution_figure(groups))),
    ]
    if len(summaries) > 1:
        sections.append(section("Sweep", figure_html(sweep_figure(summaries))))
    sections += [
        section("Over time", figure_html(timeline_figure(groups))),
        section("The client's own overhead", _client_table(summaries)),
        section("The server's own count", _server_table(summaries)),
        section("Configuration", _key_value_table(_flat_config(config))),
        section("Environment", _key_value_table(document.get("environment", {}))),
        section("Raw data", _raw_data(records_href, len(rows), document)),
    ]
    title = f"minserve bench · {html.escape(str(config.get('options', {}).get('base_url', '')))}"
    return PAGE.format(title=title, plotly_js=get_plotlyjs(), body="\n".join(sections))


def write_bundle(out_dir: Path) -> Path:
    """Read ``summary.json`` and ``records.jsonl`` in ``out_dir`` and write ``report.html`` beside them."""
    out_dir = Path(out_dir)
    document = json.loads((out_dir / "summary.json").read_text())
    rows = read_records(out_dir / "records.jsonl")
    path = out_dir / BUNDLE_NAME
    path.write_text(build_html(document, rows))
    return path


def figure_html(fig: go.Figure) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, include_mathjax=False, config={"displaylogo": False})


def section(title: str, content: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>\n{content}\n</section>"


def html_table(header: Sequence[str], rows: Iterable[Sequence[Any]], css: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _verdict_table(summaries: Sequence[dict[str, Any]]) -> str:
    judged = [s for s in summaries if "verdict" in s]
    if not judged:
        return "<p>No SLO was given (<code>--slo-ttft-ms</code>, <code>--slo-tpot-ms</code>, …), so no verdict.</p>"
    contract = ", ".join(f"{k.removesuffix('_ms')} ≤ {v:g} ms" for k, v in judged[0]["slo"].items() if k != "name")
    rows = []
    for s in judged:
        v = s["verdict"]
        badge = '<b class="pass">PASS</b>' if v["passed"] else '<b class="fail">FAIL</b>'
        rows.append([
            html.escape(s["label"]), badge, f"{cell_text(v['attainment'])} (≥ {v['required_attainment']:g})",
            f"{cell_text(v['availability'])} (≥ {v['required_availability']:g})", cell_text(s.get("goodput_rps")),
            cell_text(s["request_throughput_rps"]), cell_text(s.get("usd_per_million_output_tokens")),
        ])  # fmt: skip
    header = ["run", "verdict", "attainment", "availability", "goodput req/s", "throughput req/s", "$ / M tokens"]
    note = (
        f"<p>Contract: {html.escape(contract)}. Attainment counts the requests the client did not cancel on "
        "purpose; goodput counts every request.</p>"
    )
    return note + html_table(header, rows)


def _summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    header = [h for h, _ in TABLE_COLUMNS]
    rows = [[cell_text(lookup(s, key)) for _, key in TABLE_COLUMNS] for s in summaries]
    return "<p>Latencies in ms, throughput per second.</p>" + html_table(header, rows, "numbers")


def _errors_table(summaries: Sequence[dict[str, Any]]) -> str:
    rows = [[html.escape(s["label"]), html.escape(k), n] for s in summaries for k, n in s.get("errors", {}).items()]
    return "<h3>Errors by kind</h3>" + (html_table(["run", "kind", "count"], rows) if rows else "<p>None.</p>")


def _client_table(summaries: Sequence[dict[str, Any]]) -> str:
    rows = [
        [html.escape(s["label"]), cell_text(lookup(s, "client_lag_ms.p50")), cell_text(lookup(s, "client_lag_ms.p99")),
         cell_text(s.get("client_cpu_s")), cell_text(s.get("client_cpu_util"))]
        for s in summaries
    ]  # fmt: skip
    note = (
        "<p>Lag is how late each request left against its timetable; CPU is the load tester's own process "
        "time. A lag of more than a few ms, or CPU near 1.0, means the client, not the server, limited the run.</p>"
    )
    return note + html_table(["run", "send lag p50 ms", "send lag p99 ms", "client CPU s", "CPU / wall"], rows)


def _server_table(summaries: Sequence[dict[str, Any]]) -> str:
    rows = [
        [html.escape(s["label"]), html.escape(key), cell_text(value)]
        for s in summaries
        for key, value in s.get("server", {}).items()
    ]
    if not rows:
        return "<p>The server exposes no Prometheus <code>/metrics</code> that could be read.</p>"
    note = "<p>What the server counted during each run (counters as differences, gauges as read after it).</p>"
    return note + html_table(["run", "metric", "value"], rows, "numbers")


def _flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """The command-line options, then everything else the run recorded (the workload, the salt, …)."""
    return {**config.get("options", {}), **{k: v for k, v in config.items() if k not in ("options", "argv")}}


def _key_value_table(mapping: dict[str, Any]) -> str:
    rows = [
        [html.escape(str(k)), html.escape(json.dumps(v) if not isinstance(v, str) else v)] for k, v in mapping.items()
    ]
    return html_table(["key", "value"], rows)


def _raw_data(records_href: str, num_rows: int, document: dict[str, Any]) -> str:
    summary_json = html.escape(json.dumps(document, indent=1))
    return (
        f'<p><a href="{html.escape(records_href)}">{html.escape(records_href)}</a>: {num_rows} per-request records '
        '(every chunk time, status and error kind), beside <a href="summary.json">summary.json</a>. '
        "The summary, as this page was built from it:</p>"
        f"<details><summary>summary.json</summary><pre>{summary_json}</pre></details>"
    )


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<script>{plotly_js}</script>
<style>
body {{ font-family: system-ui, Helvetica, Arial, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }}
table.numbers td {{ text-align: right; }} .pass {{ color: #009E73; }} .fail {{ color: #D55E00; }}
pre {{ background: #f6f6f6; padding: 0.5rem; overflow-x: auto; font-size: 0.8rem; }}
</style></head>
<body><h1>{title}</h1>
{body}
</body></html>
"""

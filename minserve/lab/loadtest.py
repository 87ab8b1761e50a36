"""Chapter 10: load tests run from a notebook, and the tables, figures and widget that read their evidence.

The load tester itself is :mod:`minserve.bench`; this module only drives it from a notebook and reads what it
leaves. Four groups:

* running: the chapter calls :func:`minserve.bench.benchmark.run_benchmark` itself; this module adds
  :func:`run_with_workers`, the client that *causes* coordinated omission (a timetable walked by a fixed
  pool of workers), kept here to be measured, never used to measure, and :func:`relabel`;
* rows: the rows ``records.jsonl`` holds (:func:`minserve.bench.report.record_rows`), read by
  :func:`rows_to_records`, :func:`max_in_flight` and :func:`from_intended_ms`;
* tables and figures: Little's law, coordinated omission, the knee of a rate sweep, the prefix cache, the
  client's count against the server's;
* the bundle explorer widget, whose callback :func:`explore_run` is a plain function.

The tables and figures take run summaries (``BenchmarkResult.summaries`` or ``summary.json``'s ``runs``) or
record rows (``records.jsonl``), so they read a saved bundle as well as a result in memory; only
:func:`littles_law_table` needs the runs themselves, for their concurrency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from IPython.display import display
from plotly.subplots import make_subplots

from minserve import slo
from minserve.bench import bundle, server_metrics
from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.benchmark import BenchmarkResult
from minserve.bench.client import ClientConfig, RequestResult, send_request
from minserve.bench.metrics import to_slo_record
from minserve.bench.report import lookup, record_rows
from minserve.bench.runner import RunResult, run_sync
from minserve.bench.workload import BenchRequest
from minserve.lab.figures import latency_ecdf, latency_histogram
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme
from minserve.lab.widgets import attainment_for_thresholds, slider_range_ms, summary_html

EXPLORER_METRICS: dict[str, str] = {"TTFT": "ttft", "TPOT": "tpot", "inter-token latency": "itl", "E2E": "e2e"}
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestResult))


# --- running a load test from a notebook --------------------------------------------------------------------


def relabel(result: BenchmarkResult, *labels: str) -> BenchmarkResult:
    """The same runs under new labels (one per run, in order): the arrival alone names a run ``rate=4``, and
    two workloads at the same rate would share a label, and be pooled by anything that groups by it."""
    if len(labels) != len(result.runs):
        raise ValueError(f"{len(result.runs)} runs need {len(result.runs)} labels, got {len(labels)}")
    runs = [dataclasses.replace(run, label=label) for run, label in zip(result.runs, labels)]
    summaries = [{**summary, "label": label} for summary, label in zip(result.summaries, labels)]
    return BenchmarkResult(runs, summaries, result.config, result.environment)


async def workers_on_timetable(
    requests: Sequence[BenchRequest],
    timetable_s: Sequence[float],
    concurrency: int,
    send: Callable[[BenchRequest, float], Any],
    clock: Callable[[], float],
) -> list[RequestResult]:
    """A load tester that causes coordinated omission: ``concurrency`` workers walk an open-loop timetable.

    Request ``i`` goes to the first free worker, which sends it at its intended time or, if it was still busy
    then, the moment it frees up. When the server is slow the workers fall behind the timetable: the load
    they offer drops exactly when it should not, and the waiting happens in the client, unseen by a latency
    measured from the actual send. ``intended_s`` keeps the timetable's time, so the lag stays visible.
    """
    pending = iter(enumerate(zip(requests, timetable_s)))  # shared: next() never yields, so no lock is needed
    results: list[RequestResult | None] = [None] * len(requests)

    async def worker() -> None:
        for position, (request, intended_s) in pending:
            delay_s = intended_s - clock()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            results[position] = await send(request, intended_s)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [r for r in results if r is not None]


def run_with_workers(
    client: ClientConfig,
    requests: Sequence[BenchRequest],
    arrival: OpenLoop,
    concurrency: int,
    label: str | None = None,
) -> RunResult:
    """One run of :func:`workers_on_timetable` against a real server, labelled ``rate=…, N workers`` by default."""

    async def main() -> RunResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timetable = arrival.timetable(len(requests))
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(client.timeout_s)) as http:
            # The clock starts once the client exists: building it (an SSL context) is not the first send's lag.
            start, cpu_start = time.perf_counter(), time.process_time()

            def clock() -> float:
                return time.perf_counter() - start

            async def send(request: BenchRequest, intended_s: float) -> RequestResult:
                return await send_request(http, client, request, intended_s, clock)

            results = await workers_on_timetable(requests, timetable, concurrency, send, clock)
            duration_s, cpu_s = clock(), time.process_time() - cpu_start
        name = label or f"{arrival.label}, {concurrency} workers"
        return RunResult(name, ClosedLoop(concurrency), results, duration_s, cpu_s)

    return run_sync(main())


# --- rows: the records.jsonl view of a run ------------------------------------------------------------------


def rows_to_records(rows: Iterable[Mapping[str, Any]]) -> list[slo.RequestRecord]:
    """:class:`minserve.slo.RequestRecord` per row, exactly as the load tester's summary computed them."""
    return [to_slo_record(RequestResult(**{k: row[k] for k in _RESULT_FIELDS if k in row})) for row in rows]


def max_in_flight(rows: Iterable[Mapping[str, Any]]) -> int:
    """The most requests in flight at once (sent, not yet ended), from the rows' send and end times."""
    events = sorted(p for row in rows for p in ((row["sent_s"], 1), (row["end_s"], -1)))  # ends sort first
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def mean_in_flight(rows: Sequence[Mapping[str, Any]], duration_s: float) -> float:
    """The time-average number of requests in flight over ``duration_s``: Σ (end − sent) / duration."""
    return sum(row["end_s"] - row["sent_s"] for row in rows) / duration_s if duration_s > 0 else math.nan


def from_intended_ms(row: Mapping[str, Any], metric: str = "e2e") -> float | None:
    """TTFT or E2E of one row in ms, measured from when the timetable *intended* to send it.

    That is what a user who arrived on time waited: the client's lag plus what the client measured.
    """
    end_s = row["end_s"] if metric == "e2e" else (row["chunk_times_s"] or [None])[0]
    return None if end_s is None else (end_s - row["intended_s"]) * 1e3


def from_sent_ms(row: Mapping[str, Any], metric: str = "e2e") -> float | None:
    """TTFT or E2E of one row in ms, from the *actual* send (what the load tester reports)."""
    end_s = row["end_s"] if metric == "e2e" else (row["chunk_times_s"] or [None])[0]
    return None if end_s is None else (end_s - row["sent_s"]) * 1e3


# --- tables -------------------------------------------------------------------------------------------------


def workload_lengths(requests: Sequence[BenchRequest], count_tokens: Callable[[str], int]) -> pd.DataFrame:
    """One row per request: prompt tokens (counted by the server's tokenizer), output tokens, prefix, cancel."""
    rows = [
        {
            "prompt_tokens": len(r.prompt) if isinstance(r.prompt, list) else count_tokens(r.prompt),
            "output_tokens": r.max_tokens,
            "shares_prefix": r.shares_prefix,
            "cancelled_after": r.cancel_after_chunks,
        }
        for r in requests
    ]
    return pd.DataFrame(rows, columns=["prompt_tokens", "output_tokens", "shares_prefix", "cancelled_after"])


def length_stats(lengths: pd.DataFrame) -> pd.DataFrame:
    """Mean, median, p90, p99 and max of the prompt and output lengths (tokens): a lognormal's long right tail."""
    rows = {}
    for column in ("prompt_tokens", "output_tokens"):
        values = lengths[column].tolist()
        rows[column] = {
            "mean": statistics.fmean(values) if values else math.nan,
            **{f"p{q}": slo.percentile(values, q) for q in (50, 90, 99)},
            "max": max(values, default=math.nan),
        }
    return pd.DataFrame.from_dict(rows, orient="index").round(1)


def runs_table(summaries: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per run: counts, request and token throughput, goodput, p50/p99 latencies (ms), client lag."""
    columns = {
        "requests": "requests",
        "ok": "ok",
        "failed": "failed",
        "cancelled": "cancelled",
        "req/s": "request_throughput_rps",
        "tok/s": "output_throughput_tps",
        "goodput req/s": "goodput_rps",
        "TTFT p50": "ttft_ms.p50",
        "TTFT p99": "ttft_ms.p99",
        "TPOT p50": "tpot_ms.p50",
        "TPOT p99": "tpot_ms.p99",
        "E2E p50": "e2e_ms.p50",
        "E2E p99": "e2e_ms.p99",
        "lag p99": "client_lag_ms.p99",
    }
    rows = [{"run": s["label"], **{h: lookup(dict(s), k) for h, k in columns.items()}} for s in summaries]
    table = pd.DataFrame(rows, columns=["run", *columns]).set_index("run")
    return table.dropna(axis="columns", how="all").round(2)


def littles_law_table(result: BenchmarkResult) -> pd.DataFrame:
    """Closed-loop runs against Little's law, L = λW: concurrency, λ (ok req/s), W (mean E2E), λW, in flight.

    In a closed loop the number in the system is held at the concurrency, so λ = L / W: throughput is fixed
    by how long each request takes. ``λW`` can never exceed the time-average in flight, which never exceeds
    the most in flight, which never exceeds the concurrency.
    """
    rows = []
    for run, summary in zip(result.runs, result.summaries):
        if not isinstance(run.arrival, ClosedLoop):
            continue
        run_rows = record_rows([run])
        ok_e2e = [row["e2e_ms"] / 1e3 for row in run_rows if row["status"] == "ok"]
        throughput = summary["request_throughput_rps"]
        wait_s = statistics.fmean(ok_e2e) if ok_e2e else math.nan
        rows.append(
            {
                "run": run.label,
                "concurrency C": run.arrival.concurrency,
                "λ req/s": throughput,
                "W mean E2E s": wait_s,
                "λ·W": throughput * wait_s,
                "mean in flight": mean_in_flight(run_rows, run.duration_s),
                "max in flight": max_in_flight(run_rows),
            }
        )
    return pd.DataFrame(rows).set_index("run").round(3)


def coordinated_omission_table(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Per run: the client's send lag, and TTFT and E2E p50/p99 from the actual send and from the intended one.

    An honest open-loop client has almost no lag, so both columns agree. A client whose sends wait for
    answers reports the small "actual" numbers while its users waited the "intended" ones.
    """
    out = []
    for run, run_rows in bundle.rows_by_run(rows).items():
        ok = [row for row in run_rows if row["status"] == "ok"]
        lags = [(row["sent_s"] - row["intended_s"]) * 1e3 for row in run_rows]
        entry: dict[str, Any] = {"run": run, "lag p50": slo.percentile(lags, 50), "lag max": max(lags, default=0)}
        for metric in ("ttft", "e2e"):
            for name, measure in (("actual", from_sent_ms), ("intended", from_intended_ms)):
                values = [v for row in ok if (v := measure(row, metric)) is not None]
                for q in (50, 99):
                    entry[f"{metric.upper()} p{q} from {name}"] = slo.percentile(values, q)
        out.append(entry)
    return pd.DataFrame(out).set_index("run").round(1)


def knee_table(summaries: Sequence[Mapping[str, Any]], offered_rps: Sequence[float]) -> pd.DataFrame:
    """A rate sweep, one row per offered rate: achieved throughput, TTFT and TPOT tails, the server's queue time.

    ``server queue ms`` is the server's own mean time from arrival to first step (its Prometheus
    ``request_queue_time_seconds`` sum over count during the run): the queue seen from inside.
    """
    rows = []
    for rate, s in zip(offered_rps, summaries):
        server = s.get("server", {})
        count = server.get("request_queue_time_seconds_count", 0)
        queue_ms = server.get("request_queue_time_seconds_sum", math.nan) / count * 1e3 if count else math.nan
        rows.append(
            {
                "run": s["label"],
                "offered req/s": rate,
                "achieved req/s": s["request_throughput_rps"],
                "tok/s": s["output_throughput_tps"],
                "TTFT p50": lookup(dict(s), "ttft_ms.p50"),
                "TTFT p99": lookup(dict(s), "ttft_ms.p99"),
                "TPOT p50": lookup(dict(s), "tpot_ms.p50"),
                "TPOT p99": lookup(dict(s), "tpot_ms.p99"),
                "server queue ms": queue_ms,
            }
        )
    return pd.DataFrame(rows).set_index("run").round(2)


def predicted_ttft_ms(
    offered_rps: float, capacity_rps: float, num_requests: int, base_ttft_ms: float, quantile: float = 0.5
) -> float:
    """TTFT at ``quantile`` of a finite run, from a fluid queue: below capacity, the unloaded TTFT; above, a wait.

    ``num_requests`` arrive at ``offered_rps`` and leave at most at ``capacity_rps``. Request ``k`` arrives at
    k / λ and cannot start before k / λ*, so it waits k · (1/λ* − 1/λ) when λ > λ*. The request at the
    ``quantile`` waits q·N times that gap: past the knee a finite run has no steady state, and its latency
    grows with the number of requests sent, not only with the rate.
    """
    backlog_s = max(0.0, 1 / capacity_rps - 1 / offered_rps) if offered_rps > 0 and capacity_rps > 0 else 0.0
    return base_ttft_ms + quantile * num_requests * backlog_s * 1e3


def server_finished(summary: Mapping[str, Any]) -> dict[str, int]:
    """The server's finished requests of one run by finish reason (``stop``, ``length``, ``abort`` …)."""
    return server_metrics.finished_by_reason(summary.get("server", {}))


def accounting_table(summaries: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The client's count beside the server's: every request sent must be one the server finished.

    A request the client saw complete (ok) is one the server finished with ``stop`` or ``length``; one the
    client hung up on (cancelled) is one it finished with ``abort``.
    """
    rows = []
    for s in summaries:
        reasons = server_finished(s)
        completed = reasons.get("stop", 0) + reasons.get("length", 0)
        rows.append(
            {
                "run": s["label"],
                "sent": s["requests"],
                "client ok": s["ok"],
                "client failed": s["failed"],
                "client cancelled": s["cancelled"],
                "server stop+length": completed,
                "server abort": reasons.get("abort", 0),
                "server other": sum(n for k, n in reasons.items() if k not in ("stop", "length", "abort")),
                "accounted for": not accounting_problems(s),
            }
        )
    return pd.DataFrame(rows).set_index("run")


def accounting_problems(summary: Mapping[str, Any]) -> list[str]:
    """What does not add up in one run's count, client against server; ``[]`` when every request is accounted for."""
    problems = []
    if summary["ok"] + summary["failed"] + summary["cancelled"] != summary["requests"]:
        problems.append(f"ok + failed + cancelled ≠ {summary['requests']} sent")
    if "server" not in summary:
        return [*problems, "no server metrics to compare with"]
    reasons = server_finished(summary)
    if reasons.get("stop", 0) + reasons.get("length", 0) != summary["ok"]:
        problems.append(
            f"server completed {reasons.get('stop', 0) + reasons.get('length', 0)}, client ok {summary['ok']}"
        )
    if reasons.get("abort", 0) != summary["cancelled"]:
        problems.append(f"server aborted {reasons.get('abort', 0)}, client cancelled {summary['cancelled']}")
    if summary["failed"]:
        problems.append(f"{summary['failed']} failed: {summary.get('errors')}")
    return problems


def cache_table(summaries: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The prefix cache as the server counted it (prompt tokens looked up, found cached) beside TTFT and TPOT."""
    rows = []
    for s in summaries:
        server = s.get("server", {})
        queries = server.get("prefix_cache_queries_total", 0.0)
        hits = server.get("prefix_cache_hits_total", 0.0)
        rows.append(
            {
                "run": s["label"],
                "prompt tokens": round(queries),
                "found cached": round(hits),
                "hit rate": hits / queries if queries else math.nan,
                "TTFT p50": lookup(dict(s), "ttft_ms.p50"),
                "TTFT p99": lookup(dict(s), "ttft_ms.p99"),
                "TPOT p50": lookup(dict(s), "tpot_ms.p50"),
            }
        )
    return pd.DataFrame(rows).set_index("run").round(3)


def tail_table(summaries: Sequence[Mapping[str, Any]], metric: str = "ttft_ms") -> pd.DataFrame:
    """p50, p90, p95, p99 and the p99/p50 ratio of one metric (ms) per run: how far the tail is from the middle."""
    rows = []
    for s in summaries:
        dist = s.get(metric, {})
        p50, p99 = dist.get("p50"), dist.get("p99")
        ratio = p99 / p50 if p50 and p99 is not None else math.nan
        quantiles = {q: dist.get(q) for q in ("p50", "p90", "p95", "p99")}
        rows.append({"run": s["label"], "count": dist.get("count"), **quantiles, "p99 / p50": ratio})
    return pd.DataFrame(rows).set_index("run").round(2)


def verdict_table(summaries: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The SLO verdict per run as the bundle states it: pass, attainment, availability, goodput, cost."""
    rows = []
    for s in summaries:
        v = s.get("verdict", {})
        rows.append(
            {
                "run": s["label"],
                "verdict": ("PASS" if v["passed"] else "FAIL") if v else "-",
                "attainment": v.get("attainment"),
                "availability": v.get("availability"),
                "goodput req/s": s.get("goodput_rps"),
                "throughput req/s": s["request_throughput_rps"],
                "$ / M output tokens": s.get("usd_per_million_output_tokens"),
            }
        )
    return pd.DataFrame(rows).set_index("run").round(3)


def sample_outputs(rows: Sequence[Mapping[str, Any]], count: int = 3, chars: int = 80) -> pd.DataFrame:
    """A few ok requests' generated text (the start of it): a load test of fast garbage would pass too."""
    ok = [row for row in rows if row["status"] == "ok" and row.get("text")]
    step = max(1, len(ok) // max(count, 1))
    chosen = ok[::step][:count]
    rows = [
        {"run": r["run"], "index": r["index"], "tokens": r["output_tokens"], "text": r["text"][:chars]} for r in chosen
    ]
    return pd.DataFrame(rows, columns=["run", "index", "tokens", "text"])


# --- figures ------------------------------------------------------------------------------------------------


def workload_figure(lengths: pd.DataFrame) -> go.Figure:
    """Histograms of prompt and output lengths (tokens), their mean and median marked."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["prompt tokens", "output tokens (max_tokens)"])
    for col, column in enumerate(("prompt_tokens", "output_tokens"), start=1):
        values = lengths[column].tolist()
        fig.add_trace(go.Histogram(x=values, nbinsx=30, marker_color=COLORWAY[col - 1], showlegend=False), 1, col)
        if values:
            marks = (
                ("median", slo.percentile(values, 50), "dot", "top left"),
                ("mean", statistics.fmean(values), "dash", "top right"),
            )
            for name, x, dash, where in marks:
                fig.add_vline(x=x, line_dash=dash, line_color="gray", annotation_text=name,
                              annotation_position=where, row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="tokens")
    fig.update_yaxes(title_text="requests", col=1)
    fig.update_layout(template=register_course_theme(), title=f"The workload: {len(lengths)} requests", bargap=0.05)
    return fig


def coordinated_omission_figure(rows: Iterable[Mapping[str, Any]], metric: str = "e2e") -> go.Figure:
    """Per run (side by side): each request's latency against its *intended* send time, from both send times.

    Filled markers: measured from the actual send (what the client reports). Open markers: from the intended
    send (what the user waited). Where the two part, the client fell behind its timetable.
    """
    groups = bundle.rows_by_run(rows)
    fig = make_subplots(rows=1, cols=max(1, len(groups)), subplot_titles=list(groups), shared_yaxes=True)
    for col, run_rows in enumerate(groups.values(), start=1):
        ok = [row for row in run_rows if row["status"] == "ok"]
        xs = [row["intended_s"] for row in ok]
        for name, measure, symbol, color in (
            ("from the intended send", from_intended_ms, "circle-open", SLO_COLOR),
            ("from the actual send", from_sent_ms, "circle", COLORWAY[0]),
        ):
            fig.add_scatter(
                x=xs, y=[measure(row, metric) for row in ok], mode="markers", name=name, legendgroup=name,
                marker={"symbol": symbol, "color": color, "size": 7}, showlegend=col == 1, row=1, col=col,
            )  # fmt: skip
    label = "E2E" if metric == "e2e" else "TTFT"
    fig.update_xaxes(title_text="intended send time (s into the run)")
    fig.update_yaxes(title_text=f"{label} (ms)", col=1)
    fig.update_layout(template=register_course_theme(), title=f"Coordinated omission: {label} from which send?")
    _legend_below(fig)
    return fig


def knee_figure(
    summaries: Sequence[Mapping[str, Any]],
    offered_rps: Sequence[float],
    capacity_rps: float,
    num_requests: int,
    base_ttft_ms: float,
) -> go.Figure:
    """Left: achieved against offered throughput, with the prediction min(λ, λ*). Right: TTFT p50 and p99
    against the offered rate, with the fluid-queue prediction of :func:`predicted_ttft_ms`. Both on log x."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["throughput (req/s)", "TTFT (ms)"])
    rates = list(offered_rps)
    grid = sorted({*rates, capacity_rps}) if rates else []
    achieved = [s["request_throughput_rps"] for s in summaries]
    fig.add_scatter(x=grid, y=grid, mode="lines", line={"dash": "dot", "color": "gray"}, name="achieved = offered",
                    row=1, col=1)  # fmt: skip
    predicted_throughput = [min(r, capacity_rps) for r in grid]
    fig.add_scatter(x=grid, y=predicted_throughput, mode="lines", line={"dash": "dash", "color": SLO_COLOR},
                    name="predicted min(λ, λ*)", row=1, col=1)  # fmt: skip
    fig.add_scatter(
        x=rates, y=achieved, mode="lines+markers", name="measured throughput", line_color=COLORWAY[0], row=1, col=1
    )
    for q, color in (("p50", COLORWAY[0]), ("p99", COLORWAY[1])):
        fig.add_scatter(x=rates, y=[lookup(dict(s), f"ttft_ms.{q}") for s in summaries], mode="lines+markers",
                        name=f"measured TTFT {q}", line_color=color, row=1, col=2)  # fmt: skip
    predicted = [predicted_ttft_ms(r, capacity_rps, num_requests, base_ttft_ms) for r in grid]
    fig.add_scatter(x=grid, y=predicted, mode="lines", line={"dash": "dash", "color": SLO_COLOR},
                    name="predicted TTFT p50", row=1, col=2)  # fmt: skip
    for col, axis in ((1, ""), (2, "2")):  # on a log axis a shape takes the value, an annotation its log10
        fig.add_vline(x=capacity_rps, line_dash="dot", line_color="gray", row=1, col=col)
        fig.add_annotation(x=math.log10(capacity_rps), y=1, xref=f"x{axis}", yref=f"y{axis} domain", text="λ*",
                           showarrow=False, xanchor="left", yanchor="top")  # fmt: skip
    fig.update_xaxes(type="log", title_text="offered rate λ (req/s)")
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(template=register_course_theme(), title="A rate sweep to the knee", height=500)
    _legend_below(fig)
    return fig


def ttft_ecdf_figure(groups: Mapping[str, Sequence[Mapping[str, Any]]], metric: str = "ttft_ms") -> go.Figure:
    """ECDFs of one metric (ms, ok requests) with one line per group of rows (``{name: rows}``)."""
    fig = go.Figure()
    for index, (name, rows) in enumerate(groups.items()):
        xs, ys = slo.ecdf_points(bundle.latencies_ms(rows, metric))
        fig.add_scatter(
            x=xs, y=ys, mode="lines", line_shape="hv", name=name, line_color=COLORWAY[index % len(COLORWAY)]
        )
    label = dict(bundle.METRICS_MS).get(metric, metric)
    fig.add_hline(y=0.99, line_dash="dot", line_color="gray", annotation_text="p99", annotation_position="left")
    fig.update_layout(template=register_course_theme(), title=f"{label}: empirical CDF", xaxis_title=label,
                      yaxis_title="fraction of requests ≤ x", yaxis_range=[0, 1.05])  # fmt: skip
    return fig


def _legend_below(fig: go.Figure) -> None:
    """Move the legend under the plot: above it, it collides with the subplot titles."""
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.2, "xanchor": "left", "x": 0},
                      margin={"b": 120})  # fmt: skip


# --- the bundle explorer ------------------------------------------------------------------------------------


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

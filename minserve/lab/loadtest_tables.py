"""Chapter 10's tables: a load test's runs, summaries and rows arranged for reading.

Each table takes run summaries (``BenchmarkResult.summaries`` or ``summary.json``'s ``runs``, keyed as
:func:`minserve.bench.metrics.summarize` writes them) or record rows (``records.jsonl``), so it reads a saved
bundle as well as a result in memory; only :func:`littles_law_table` needs the runs themselves, for their
concurrency. The tables: the workload's lengths, the runs side by side, Little's law, coordinated omission,
the knee of a rate sweep, the prefix cache, the tail, the verdict, sample answers, and the client's count
against the server's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from minserve import slo
from minserve.bench import bundle, server_metrics
from minserve.bench.arrivals import ClosedLoop
from minserve.bench.benchmark import BenchmarkResult
from minserve.bench.report import record_rows
from minserve.bench.rows import from_intended_ms, from_sent_ms, max_in_flight, mean_in_flight
from minserve.bench.workload import BenchRequest
from minserve.slo import lookup


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
                "server queue ms": server_queue_ms(s),
            }
        )
    return pd.DataFrame(rows).set_index("run").round(2)


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


def server_queue_ms(summary: Mapping[str, Any]) -> float:
    """The server's mean queue time in one run (arrival to first step, ms): its Prometheus histogram's sum over
    its count during the run; ``nan`` without server metrics or finished requests."""
    server = summary.get("server", {})
    count = server.get("request_queue_time_seconds_count", 0)
    return server.get("request_queue_time_seconds_sum", math.nan) / count * 1e3 if count else math.nan


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

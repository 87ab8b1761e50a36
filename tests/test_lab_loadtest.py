"""Chapter 10's helpers, on hand-made runs (no server is started here).

The lab's tables, figures and bundle explorer (:mod:`minserve.lab.loadtest_tables`, ``loadtest_figures``,
``bundle_view``), and what they build on: :mod:`minserve.bench.rows`, :mod:`minserve.bench.omission`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import plotly.graph_objects as go
import pytest

from minserve import lab, slo
from minserve.bench import bundle, omission, runner
from minserve.bench import rows as bench_rows
from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.benchmark import BenchmarkResult, relabel
from minserve.bench.client import ClientConfig, RequestResult
from minserve.bench.metrics import Pricing, summarize, to_slo_record
from minserve.bench.report import record_rows
from minserve.bench.runner import RunResult
from minserve.bench.workload import BenchRequest, LengthDist, WorkloadSpec, build_requests
from minserve.capacity import queueing
from minserve.lab import bundle_view
from minserve.lab import loadtest_figures as figures
from minserve.lab import loadtest_tables as tables

CHAT = slo.SLO("chat", ttft_s=0.25, tpot_s=0.06)


def _result(index, intended, sent, ttft=0.05, chunks=5, gap=0.01, status="ok", tokens=None, error=None):
    times = [sent + ttft + k * gap for k in range(chunks)]
    return RequestResult(
        index=index,
        intended_s=intended,
        sent_s=sent,
        chunk_times_s=times,
        end_s=(times[-1] if times else sent) + 0.002,
        status=status,
        error=error,
        output_tokens=chunks if tokens is None else tokens,
        prompt_tokens=12,
        output_tokens_source="usage",
        text="x" * chunks,
    )


def _open_run(label="rate=4", n=12, lag=0.0, seed=0, statuses=None):
    rng = random.Random(seed)
    results = []
    for i in range(n):
        intended = i * 0.25
        status = statuses[i] if statuses else "ok"
        chunks = 4 if status == "cancelled" else rng.randint(1, 9)
        results.append(_result(i, intended, intended + lag * i, rng.uniform(0.02, 0.4), chunks, 0.02, status))
    return RunResult(label, OpenLoop(4.0), results, max(r.end_s for r in results) + 0.01, 0.1)


def _closed_run(concurrency=2, n=10, service=0.1):
    """A closed loop simulated by hand: each worker sends the next request the moment its last one ends."""
    free = [0.0] * concurrency
    results = []
    for i in range(n):
        worker = min(range(concurrency), key=free.__getitem__)
        sent = free[worker]
        result = _result(i, sent, sent, ttft=0.02, chunks=5, gap=(service - 0.022) / 4)
        free[worker] = result.end_s
        results.append(result)
    return RunResult(f"concurrency={concurrency}", ClosedLoop(concurrency), results, max(free), 0.05)


def _server(ok=0, cancelled=0, hits=0.0, queries=100.0, queue_sum=0.5, count=None):
    delta = {
        "prefix_cache_hits_total": hits,
        "prefix_cache_queries_total": queries,
        "request_queue_time_seconds_sum": queue_sum,
        "request_queue_time_seconds_count": float(count if count is not None else ok + cancelled),
        "kv_cache_usage_perc": 0.0,
    }
    if ok:
        delta['request_success_total{finished_reason="length"}'] = float(ok)
    if cancelled:
        delta['request_success_total{finished_reason="abort"}'] = float(cancelled)
    return delta


def _summary(run, server=True, contract=CHAT):
    summary = summarize(run, contract, Pricing(0.1))
    if server:
        summary["server"] = _server(ok=summary["ok"], cancelled=summary["cancelled"])
    return summary


def _result_set(*runs):
    return BenchmarkResult(list(runs), [_summary(run) for run in runs], {"options": {"base_url": "x"}}, {})


# --- running ---------------------------------------------------------------------------------------------------


def _fake_sender(service_s, log):
    async def send(request, intended_s, clock):
        sent = clock()
        log.append(("start", sent))
        await asyncio.sleep(service_s)
        end = clock()
        log.append(("end", end))
        return RequestResult(request.index, intended_s, sent, [end], end, output_tokens=1)

    return send


def _run_workers(timetable, concurrency, service_s):
    requests = [BenchRequest(i, f"p{i}", 4) for i in range(len(timetable))]
    log: list = []
    send = _fake_sender(service_s, log)

    async def main():
        start = time.perf_counter()

        def clock():
            return time.perf_counter() - start

        return await omission.workers_on_timetable(
            requests, timetable, concurrency, lambda r, t: send(r, t, clock), clock
        )  # fmt: skip

    return asyncio.run(main())


def test_workers_on_timetable_fall_behind_a_fast_timetable():
    timetable = [0.0] * 6  # all due at once; two workers, 30 ms each
    results = _run_workers(timetable, concurrency=2, service_s=0.03)
    assert [r.index for r in results] == list(range(6))  # in timetable order
    rows = [{"sent_s": r.sent_s, "end_s": r.end_s} for r in results]
    assert bench_rows.max_in_flight(rows) <= 2
    lags = [r.client_lag_s for r in results]
    assert lags[-1] >= 0.05  # the sixth request waited for two rounds of service in the client
    assert all(lag >= -1e-3 for lag in lags)  # never early


def test_workers_on_timetable_keep_a_slow_timetable():
    timetable = [0.0, 0.05, 0.10]
    results = _run_workers(timetable, concurrency=3, service_s=0.01)
    assert all(r.sent_s >= r.intended_s - 1e-3 for r in results)
    assert [r.intended_s for r in results] == timetable


def test_run_with_workers_labels_and_counts(monkeypatch):
    log: list = []
    fake = _fake_sender(0.01, log)

    async def send_request(http, config, request, intended_s, clock):
        return await fake(request, intended_s, clock)

    monkeypatch.setattr(runner, "send_request", send_request)  # the workers send through the runner's client
    client = ClientConfig("http://127.0.0.1:9", "m")
    requests = [BenchRequest(i, f"p{i}", 4) for i in range(5)]
    run = omission.run_with_workers(client, requests, OpenLoop(1000.0, seed=1), 2)
    assert run.label == "rate=1000, 2 workers" and run.arrival == ClosedLoop(2)
    assert len(run.results) == 5 and run.duration_s > 0
    assert bench_rows.max_in_flight([{"sent_s": r.sent_s, "end_s": r.end_s} for r in run.results]) <= 2
    assert omission.run_with_workers(client, requests[:1], OpenLoop(1.0), 1, label="mine").label == "mine"


def test_relabel():
    result = _result_set(_open_run("rate=4"), _open_run("rate=4", seed=1))
    renamed = relabel(result, "plain", "shared prefix")
    assert [r.label for r in renamed.runs] == ["plain", "shared prefix"]
    assert [s["label"] for s in renamed.summaries] == ["plain", "shared prefix"]
    assert [s["label"] for s in result.summaries] == ["rate=4", "rate=4"]  # the original is untouched
    with pytest.raises(ValueError, match="2 labels"):
        relabel(result, "one")


# --- rows ------------------------------------------------------------------------------------------------------


def test_record_rows_are_what_records_jsonl_holds(tmp_path):
    run = _open_run(statuses=["ok"] * 10 + ["cancelled", "failed"])
    rows = record_rows([run])
    result = BenchmarkResult([run], [_summary(run)], {}, {})
    result.save(tmp_path, bundle=False)
    assert rows == bundle.read_records(tmp_path / "records.jsonl")
    assert {row["run"] for row in rows} == {"rate=4"} and len(rows) == 12


def test_rows_to_records_round_trip():
    run = _open_run(n=8)
    rows = json.loads(json.dumps(record_rows([run])))
    assert bench_rows.rows_to_records(rows) == [to_slo_record(r) for r in run.results]


def test_max_and_mean_in_flight():
    rows = [{"sent_s": 0.0, "end_s": 1.0}, {"sent_s": 0.5, "end_s": 2.0}, {"sent_s": 1.0, "end_s": 1.5}]
    assert bench_rows.max_in_flight(rows) == 2  # the first ends at 1.0 just as the third starts
    assert bench_rows.max_in_flight([]) == 0
    assert bench_rows.mean_in_flight(rows, 2.0) == pytest.approx((1.0 + 1.5 + 0.5) / 2.0)
    assert math.isnan(bench_rows.mean_in_flight(rows, 0.0))


def test_latency_from_intended_adds_the_lag():
    row = {"intended_s": 1.0, "sent_s": 1.5, "chunk_times_s": [1.7, 1.8], "end_s": 2.0}
    assert bench_rows.from_sent_ms(row) == pytest.approx(500.0)
    assert bench_rows.from_intended_ms(row) == pytest.approx(1000.0)
    assert bench_rows.from_sent_ms(row, "ttft") == pytest.approx(200.0)
    assert bench_rows.from_intended_ms(row, "ttft") == pytest.approx(700.0)
    assert bench_rows.from_intended_ms({**row, "chunk_times_s": []}, "ttft") is None


# --- tables ----------------------------------------------------------------------------------------------------


def test_workload_lengths_in_the_given_tokens():
    spec = WorkloadSpec(num_requests=40, prompt_len=LengthDist("lognormal", 50, 40, 400),
                        output_len=LengthDist("lognormal", 20, 15, 200), cancel_fraction=0.5, seed=1)  # fmt: skip
    count = len  # one token per character: a tokenizer the test can check
    requests = build_requests(spec, count)
    lengths = tables.workload_lengths(requests, count)
    assert lengths["prompt_tokens"].tolist() == [len(r.prompt) for r in requests]
    assert lengths["output_tokens"].tolist() == [r.max_tokens for r in requests]
    assert lengths["cancelled_after"].notna().sum() == sum(r.cancel_after_chunks is not None for r in requests)
    ids = tables.workload_lengths([BenchRequest(0, [1, 2, 3], 5)], count)
    assert ids["prompt_tokens"].tolist() == [3]  # token-id prompts are counted as they are
    stats = tables.length_stats(lengths)
    assert list(stats.index) == ["prompt_tokens", "output_tokens"]
    assert (stats["p50"] <= stats["p99"]).all() and (stats["p99"] <= stats["max"]).all()
    fig = figures.workload_figure(lengths)
    assert len(fig.data) == 2 and list(fig.data[0].x) == lengths["prompt_tokens"].tolist()


def test_runs_and_tail_and_verdict_tables():
    run = _open_run(statuses=["ok"] * 9 + ["failed"] * 3)
    summaries = [_summary(run)]
    table = tables.runs_table(summaries)
    assert table.loc["rate=4", "ok"] == 9 and table.loc["rate=4", "failed"] == 3
    assert table.loc["rate=4", "goodput req/s"] <= table.loc["rate=4", "req/s"]
    tail = tables.tail_table(summaries, "e2e_ms")
    assert tail.loc["rate=4", "p50"] <= tail.loc["rate=4", "p99"] and tail.loc["rate=4", "p99 / p50"] >= 1
    verdict = tables.verdict_table(summaries)
    assert verdict.loc["rate=4", "verdict"] == "FAIL"  # three failures break a 99.9 % availability
    assert verdict.loc["rate=4", "$ / M output tokens"] > 0
    no_contract = tables.verdict_table([summarize(run)])
    assert no_contract.loc["rate=4", "verdict"] == "-"


def test_littles_law_table_on_a_closed_loop():
    result = _result_set(_closed_run(2, n=12), _open_run())
    table = tables.littles_law_table(result)
    assert list(table.index) == ["concurrency=2"]  # open-loop runs are left out
    row = table.loc["concurrency=2"]
    assert row["max in flight"] == 2
    assert row["λ·W"] <= row["mean in flight"] + 1e-3 <= 2 + 1e-3
    assert row["λ·W"] == pytest.approx(row["λ req/s"] * row["W mean E2E s"], abs=2e-3)


def test_coordinated_omission_table_separates_the_two_send_times():
    honest = _open_run("open loop", lag=0.0)
    late = _open_run("workers", lag=0.1)  # each request leaves 0.1 s later than the one before
    table = tables.coordinated_omission_table(record_rows([honest, late]))
    assert table.loc["open loop", "lag max"] == pytest.approx(0.0)
    assert table.loc["open loop", "E2E p99 from intended"] == table.loc["open loop", "E2E p99 from actual"]
    assert table.loc["workers", "lag max"] == pytest.approx(1100.0)
    assert table.loc["workers", "E2E p50 from intended"] > table.loc["workers", "E2E p50 from actual"]
    assert table.loc["workers", "TTFT p99 from actual"] == table.loc["open loop", "TTFT p99 from actual"]
    fig = figures.coordinated_omission_figure(record_rows([honest, late]))
    assert len(fig.data) == 4 and [t.showlegend for t in fig.data] == [True, True, False, False]


def test_predicted_ttft_is_flat_below_capacity_and_grows_with_the_run_above():
    assert queueing.predicted_ttft_ms(5.0, 10.0, 100, 20.0) == 20.0
    assert queueing.predicted_ttft_ms(10.0, 10.0, 100, 20.0) == 20.0
    # 40 req/s into 10 req/s: each request waits 75 ms more than the one before; the median (50th) 3.75 s.
    assert queueing.predicted_ttft_ms(40.0, 10.0, 100, 20.0) == pytest.approx(20.0 + 3750.0)
    assert queueing.predicted_ttft_ms(40.0, 10.0, 200, 20.0, quantile=0.99) > queueing.predicted_ttft_ms(
        40, 10, 100, 20
    )
    rates = [1, 5, 10, 20, 40, 80]
    predicted = [queueing.predicted_ttft_ms(r, 10.0, 50, 20.0) for r in rates]
    assert predicted == sorted(predicted)


def test_knee_table_and_figure():
    runs = [_open_run(f"rate={r}", seed=r) for r in (1, 2, 4)]
    summaries = [_summary(run) for run in runs]
    summaries[2]["server"] = _server(ok=12, queue_sum=1.2, count=12)
    table = tables.knee_table(summaries, [1.0, 2.0, 4.0])
    assert table["offered req/s"].tolist() == [1.0, 2.0, 4.0]
    assert table.loc["rate=4", "server queue ms"] == pytest.approx(100.0)
    summaries[0].pop("server")
    assert math.isnan(tables.knee_table(summaries, [1.0, 2.0, 4.0]).loc["rate=1", "server queue ms"])
    fig = figures.knee_figure(summaries, [1.0, 2.0, 4.0], capacity_rps=3.0, num_requests=12, base_ttft_ms=50.0)
    measured = next(t for t in fig.data if t.name == "measured throughput")
    assert list(measured.y) == [s["request_throughput_rps"] for s in summaries]
    predicted = next(t for t in fig.data if t.name == "predicted min(λ, λ*)")
    assert list(predicted.y) == [1.0, 2.0, 3.0, 3.0]


def test_accounting_matches_client_and_server():
    run = _open_run(statuses=["ok"] * 8 + ["cancelled"] * 4)
    good = _summary(run)
    assert tables.accounting_problems(good) == []
    table = tables.accounting_table([good])
    assert table.loc["rate=4", "server abort"] == 4 and table.loc["rate=4", "accounted for"]
    lost = {**good, "server": _server(ok=8, cancelled=3)}
    assert tables.accounting_problems(lost) == ["server aborted 3, client cancelled 4"]
    assert not tables.accounting_table([lost]).loc["rate=4", "accounted for"]
    assert tables.accounting_problems({**good, "ok": 7}) == [
        "ok + failed + cancelled ≠ 12 sent",
        "server completed 8, client ok 7",
    ]
    assert tables.accounting_problems({k: v for k, v in good.items() if k != "server"}) == [
        "no server metrics to compare with"
    ]
    failed = _summary(_open_run(statuses=["ok"] * 11 + ["failed"]))
    failed["server"] = _server(ok=11)
    assert tables.accounting_problems(failed) == ["1 failed: {}"]  # an error kind would be named here


def test_cache_table_reads_the_servers_prefix_counters():
    runs = [_open_run("plain"), _open_run("shared", seed=2)]
    summaries = [_summary(run) for run in runs]
    summaries[1]["server"] = _server(ok=12, hits=75.0, queries=100.0)
    table = tables.cache_table(summaries)
    assert table.loc["shared", "hit rate"] == pytest.approx(0.75) and table.loc["plain", "found cached"] == 0
    fig = figures.ttft_ecdf_figure({name: record_rows([run]) for name, run in zip(["a", "b"], runs)})
    assert [t.name for t in fig.data] == ["a", "b"]
    assert list(fig.data[0].x) == sorted(bundle.latencies_ms(record_rows([runs[0]]), "ttft_ms"))


def test_sample_outputs():
    rows = record_rows([_open_run(statuses=["ok"] * 6 + ["cancelled"] * 6)])
    sample = tables.sample_outputs(rows, count=3, chars=2)
    assert len(sample) == 3 and all(len(t) <= 2 for t in sample["text"])
    assert tables.sample_outputs([], 3).empty


# --- the bundle explorer ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_bundle(tmp_path_factory):
    runs = [_open_run("rate=2", seed=4), _open_run("rate=8", seed=5, statuses=["ok"] * 10 + ["cancelled"] * 2)]
    out = tmp_path_factory.mktemp("bundle")
    _result_set(*runs).save(out)
    return out, runs


def test_load_bundle_reads_runs_and_summaries(saved_bundle):
    out, runs = saved_bundle
    data = lab.load_bundle(out)
    assert data.runs == ["rate=2", "rate=8"] and (out / "report.html").exists()
    assert data.duration_s("rate=8") == pytest.approx(runs[1].duration_s)
    assert data.duration_s("missing") == 0.0
    no_duration = bundle_view.Bundle(out, data.groups, {}, {})
    assert no_duration.duration_s("rate=2") == pytest.approx(max(r.end_s for r in runs[0].results))


def test_attainment_from_rows_is_the_summarys_goodput(saved_bundle):
    out, _ = saved_bundle
    data = lab.load_bundle(out)
    for run in data.runs:
        mine = bundle_view.attainment_from_rows(data.groups[run], 250.0, 60.0, data.duration_s(run))
        assert mine["goodput_rps"] == pytest.approx(data.summaries[run]["goodput_rps"])
        assert mine["goodput_rps"] <= mine["request_throughput_rps"]
        loose = bundle_view.attainment_from_rows(data.groups[run], 1e6, 1e6, data.duration_s(run))
        ok = sum(row["status"] == "ok" for row in data.groups[run])
        assert loose["all"] == pytest.approx(ok / len(data.groups[run])) and mine["all"] <= loose["all"]
        assert bundle_view.attainment_from_rows(data.groups[run], 1e-6, 1e-6)["all"] == 0.0


@pytest.mark.parametrize("kind", ["CDF", "histogram"])
@pytest.mark.parametrize("metric", ["ttft", "tpot", "itl", "e2e"])
def test_explore_run_draws_the_thresholds(saved_bundle, metric, kind):
    data = lab.load_bundle(saved_bundle[0])
    fig, html = lab.explore_run(data, "rate=8", metric, kind, ttft_ms=123.0, tpot_ms=45.0)
    assert isinstance(fig, go.Figure) and fig.layout.title.text.startswith("rate=8")
    records = bench_rows.rows_to_records(data.groups["rate=8"])
    values = sorted(v * 1e3 for v in slo.metric_values_s(records, metric))
    assert sorted(fig.data[0].x) == pytest.approx(values)
    dashed = sorted(s.x0 for s in fig.layout.shapes if s.line.dash == "dash")
    assert dashed == pytest.approx({"ttft": [123.0], "e2e": []}.get(metric, [45.0]))
    assert "12 requests (10 ok, 0 failed, 2 cancelled)" in html and "goodput" in html


def test_bundle_explorer_widget_follows_its_controls(saved_bundle):
    widget = lab.bundle_explorer(saved_bundle[0], ttft_ms=250.0, tpot_ms=60.0)
    (run, metric, kind), ttft, tpot, readout, _plot = widget.children[0].children, *widget.children[1:]
    assert run.options == ("rate=2", "rate=8") and kind.value == "CDF"
    before = readout.value
    run.value = "rate=8"
    assert readout.value != before and "2 cancelled" in readout.value
    assert ttft.min > 0  # a zero threshold is no contract (SLO refuses it)
    ttft.value = ttft.min
    assert "<td style='padding:0 12px;text-align:center'>0%</td>" in readout.value
    metric.value, kind.value, tpot.value = "e2e", "histogram", tpot.max  # every control redraws without error

"""The load tester against a real minserve server: every request accounted for, and its numbers agree with
the server's own /metrics and with the engine's trace of each request."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from minserve import slo
from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.benchmark import run_benchmark
from minserve.bench.client import ClientConfig
from minserve.bench.metrics import Pricing
from minserve.bench.server_metrics import finished_by_reason
from minserve.bench.workload import LengthDist, WorkloadSpec, build_requests
from tests.servers import MODEL, RunningServer

NUM_REQUESTS = 24
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def server():
    running = RunningServer(max_num_seqs=16)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def benchmark(server):
    spec = WorkloadSpec(
        num_requests=NUM_REQUESTS,
        prompt_len=LengthDist("uniform", 24, 12),
        output_len=LengthDist("fixed", OUTPUT_TOKENS),
        shared_prefix_fraction=0.5,
        shared_prefix_len=32,
        cancel_fraction=0.25,
        cancel_after_chunks=2,
        seed=7,
    )
    client = ClientConfig(server.url, MODEL, ignore_eos=True)
    contract = slo.SLO("loose", ttft_s=60.0, tpot_s=10.0)
    arrivals = [OpenLoop(40.0, seed=1), ClosedLoop(4)]
    result = run_benchmark(client, build_requests(spec), arrivals, contract, Pricing(2.0), progress=False)
    server.wait_until_idle()
    return result


def test_every_request_is_accounted_for(benchmark):
    for run, summary in zip(benchmark.runs, benchmark.summaries):
        statuses = Counter(r.status for r in run.results)
        assert len(run.results) == NUM_REQUESTS
        assert sorted(r.index for r in run.results) == list(range(NUM_REQUESTS))
        assert statuses["ok"] + statuses["cancelled"] == NUM_REQUESTS, summary["errors"]
        assert summary["ok"] == statuses["ok"] and summary["cancelled"] == statuses["cancelled"] > 0
        for result in run.results:
            if result.status == "ok":
                assert result.output_tokens == OUTPUT_TOKENS and result.output_tokens_source == "usage"
            else:
                assert len(result.chunk_times_s) == 2  # hung up after two chunks, on purpose


def test_the_servers_counters_agree_with_the_client(benchmark):
    for run, summary in zip(benchmark.runs, benchmark.summaries):
        server = summary["server"]
        ok = [r for r in run.results if r.status == "ok"]
        by_reason = finished_by_reason(server)
        # Every request ended once on the server: ok ones at max_tokens (ignore_eos), cancelled ones by an
        # abort, unless the cancel reached the server after its last token (then it ended at max_tokens).
        length, aborted = by_reason.get("length", 0), by_reason.get("abort", 0)
        assert length + aborted == len(ok) + summary["cancelled"]
        assert length >= len(ok) and aborted <= summary["cancelled"]
        assert by_reason.get("stop", 0) == 0
        # Tokens: the ok requests' usage exactly, plus whatever the cancelled ones got before they left.
        assert server["generation_tokens_total"] >= sum(r.output_tokens for r in ok)
        assert server["prompt_tokens_total"] >= sum(r.prompt_tokens for r in ok)
        assert server["time_to_first_token_seconds_count"] == NUM_REQUESTS
        assert server["num_requests_running"] == server["num_requests_waiting"] == 0
        assert server["kv_cache_usage_perc"] == 0.0
        # Half the prompts share a 32-token prefix: the prefix cache must have found some of it.
        assert server["prefix_cache_hits_total"] > 0


def test_client_latencies_contain_the_servers(benchmark, server):
    """The server's TTFT and E2E (from its trace) are inside what the client measured around them."""
    trace = server.engine.trace_events()
    checked = 0
    for run in benchmark.runs:
        for result in run.results:
            if result.status != "ok":
                continue
            mine = [e for e in trace if e.request_id == result.response_id]
            events = {e.name: e for e in mine}
            server_ttft_s = events["first_token"].start_s - events["arrival"].start_s
            server_e2e_s = events["finished"].start_s - events["arrival"].start_s
            client_ttft_s = result.chunk_times_s[0] - result.sent_s
            assert 0 < server_ttft_s <= client_ttft_s
            assert server_ttft_s <= server_e2e_s <= result.end_s - result.sent_s
            decode_spans = [e for e in mine if e.name == "decode"]
            assert len(decode_spans) == OUTPUT_TOKENS - 1  # the prefill step made the first token
            checked += 1
    assert checked >= NUM_REQUESTS  # both runs together


def test_summary_numbers_follow_from_the_records(benchmark):
    run, summary = benchmark.runs[0], benchmark.summaries[0]
    ok = [r for r in run.results if r.status == "ok"]
    assert summary["output_throughput_tps"] == pytest.approx(sum(r.output_tokens for r in ok) / run.duration_s)
    assert summary["goodput_rps"] <= summary["request_throughput_rps"]
    assert summary["verdict"]["passed"]  # a one-minute TTFT bound: nothing on this machine misses it
    assert summary["usd_per_million_output_tokens"] == pytest.approx(
        slo.cost_per_million_tokens(2.0, summary["output_throughput_tps"])
    )
    assert summary["client_cpu_s"] > 0


def test_saved_evidence_rebuilds_the_same_bundle(benchmark, tmp_path):
    out = benchmark.save(tmp_path / "bench")
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    document = json.loads((out / "summary.json").read_text())
    assert len(rows) == 2 * NUM_REQUESTS and {row["run"] for row in rows} == {"rate=40", "concurrency=4"}
    assert document["environment"]["server_models"] == [MODEL]
    html = (out / "report.html").read_text()
    for heading in ("Verdict", "Latency", "Sweep", "The server&#x27;s own count", "Environment", "Raw data"):
        assert f"<h2>{heading}</h2>" in html, heading
    assert 'href="records.jsonl"' in html and "PASS" in html
    assert "<script src=" not in html  # plotly.js is inlined: the page needs no network


def test_bench_command_line_writes_the_evidence(server, tmp_path):
    out = tmp_path / "cli"
    command = [
        sys.executable, "-m", "minserve.cli", "bench", "serve", "--base-url", server.url, "--model", MODEL,
        "--num-prompts", "6", "--prompt-len", "lognormal:20:8", "--output-len", "4", "--ignore-eos",
        "--rates", "inf", "--slo-ttft-ms", "60000", "--tokenizer", MODEL, "--out", str(out), "--no-progress",
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert "rate=inf: SLO PASS" in finished.stdout
    assert {p.name for p in out.iterdir()} == {"records.jsonl", "summary.json", "report.html"}
    rebuilt = subprocess.run(
        [sys.executable, "-m", "minserve.cli", "bench", "report", str(out)], capture_output=True, text=True
    )
    assert rebuilt.returncode == 0 and "report.html" in rebuilt.stdout


def test_a_server_that_refuses_everything_is_counted_not_crashed(tmp_path):
    from minserve.config import ServerConfig

    running = RunningServer(ServerConfig(api_key="secret"), num_kv_blocks=64)
    try:
        client = ClientConfig(running.url, MODEL)  # no key: every request is a 401
        spec = WorkloadSpec(num_requests=5, prompt_len=LengthDist("fixed", 8), output_len=LengthDist("fixed", 2))
        result = run_benchmark(client, build_requests(spec), [OpenLoop(float("inf"))], progress=False)
    finally:
        running.stop()
    summary = result.summaries[0]
    assert summary["failed"] == 5 and summary["errors"] == {"http_401": 5}
    assert "server" not in summary  # /metrics needs the key too: nothing to compare against


def test_two_bundles_compare_side_by_side(benchmark, tmp_path):
    """``bench compare`` lines up the runs two bundles share: the same run against itself is 1.0× on every
    number; a copy whose server made twice the tokens per second is 2× on that number and better on it."""
    from minserve.bench.compare import comparison_rows, load_bundle, write_comparison

    first, second = benchmark.save(tmp_path / "a", bundle=False), benchmark.save(tmp_path / "b", bundle=False)
    document = json.loads((second / "summary.json").read_text())
    for run in document["runs"]:
        run["output_throughput_tps"] *= 2
    (second / "summary.json").write_text(json.dumps(document))
    bundles, page = write_comparison([first, second], tmp_path / "compare.html")
    rows = {(row["run"], row["bundle"]): row for row in comparison_rows(bundles)}
    doubled = rows[("rate=40", bundles[1].name)]
    assert doubled["tok/s ×"] == pytest.approx(2.0) and doubled["TTFT p99 ×"] == pytest.approx(1.0)
    assert doubled["better"] == "1/7"
    html = page.read_text()
    assert "<h2>Side by side</h2>" in html and "<h2>At concurrency=4</h2>" in html and "<script src=" not in html
    assert load_bundle(first, name="mine").name == "mine"


def test_bench_compare_command_line_refuses_what_it_cannot_compare(benchmark, tmp_path):
    run = benchmark.save(tmp_path / "run", bundle=False)
    compare = [sys.executable, "-m", "minserve.cli", "bench", "compare"]
    page = tmp_path / "c.html"
    ok = subprocess.run([*compare, str(run), str(run), "--out", str(page)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "rate=40" in ok.stdout and "(1.00×)" in ok.stdout and page.is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run([*compare, str(run), str(empty)], capture_output=True, text=True)
    assert refused.returncode == 2 and "has no summary.json" in refused.stderr
    refused = subprocess.run([*compare, str(run)], capture_output=True, text=True)
    assert refused.returncode == 2 and "at least two" in refused.stderr

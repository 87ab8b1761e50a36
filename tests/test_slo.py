"""minserve.slo: per-request metrics, percentiles, attainment, goodput, availability, error budget, cost."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest

from minserve import RequestMetrics, slo
from minserve.slo import SLO, RequestRecord


def _steady(arrival_s: float, ttft_s: float, gap_s: float, n: int, status: str = "ok") -> RequestRecord:
    """A request whose n tokens come ttft_s after arrival, then every gap_s."""
    times = [arrival_s + ttft_s + i * gap_s for i in range(n)]
    return RequestRecord(arrival_s, times, status=status)


# --- one request -------------------------------------------------------------------------------------------


def test_curriculum_tpot_number():
    assert slo.tpot_from_totals_s(0.080, 2.200, 220) * 1e3 == pytest.approx(9.68, abs=0.005)
    times = [0.080 + i * (2.120 / 219) for i in range(220)]
    record = RequestRecord(0.0, times, finish_s=2.200)
    assert record.ttft_s == pytest.approx(0.080)
    assert record.e2e_s == pytest.approx(2.200)
    assert record.tpot_s * 1e3 == pytest.approx(9.68, abs=0.005)


def test_per_request_metrics_from_timestamps():
    record = RequestRecord(10.0, [10.5, 10.75, 11.25], finish_s=11.5)
    assert record.ttft_s == pytest.approx(0.5)
    assert record.itl_s == pytest.approx([0.25, 0.5])
    assert record.max_itl_s == pytest.approx(0.5)
    assert record.e2e_s == pytest.approx(1.5)
    # TPOT counts the time after the last token too: (1.5 − 0.5) / 2, not the mean ITL 0.375.
    assert record.tpot_s == pytest.approx(0.5)
    assert record.output_tokens == 3


def test_tpot_identity_holds_on_random_requests():
    rng = random.Random(0)
    for _ in range(100):
        arrival = rng.uniform(0, 100)
        times = sorted(arrival + rng.uniform(0, 5) for _ in range(rng.randint(2, 30)))
        record = RequestRecord(arrival, times, finish_s=times[-1] + rng.uniform(0, 0.1))
        n = record.output_tokens
        assert record.ttft_s + (n - 1) * record.tpot_s == pytest.approx(record.e2e_s)
        assert sum(record.itl_s) / (n - 1) <= record.tpot_s + 1e-12  # finish ≥ last token


def test_one_token_output_has_no_tpot_and_cannot_miss_it():
    record = RequestRecord(0.0, [0.2])
    assert record.tpot_s is None and record.itl_s == [] and record.max_itl_s is None
    assert record.e2e_s == pytest.approx(0.2)  # finish defaults to the last token
    assert slo.meets(record, SLO(ttft_s=0.5, tpot_s=0.01)) == {"ttft": True, "tpot": True, "all": True}
    assert slo.meets(record, SLO(ttft_s=0.1, tpot_s=0.01))["all"] is False
    assert slo.metric_values_s([record], "tpot") == []


def test_no_tokens_misses_ttft():
    record = RequestRecord(0.0, [], finish_s=1.0)
    assert record.ttft_s is None
    assert slo.meets(record, SLO(ttft_s=5.0))["ttft"] is False


def test_from_engine_metrics():
    metrics = RequestMetrics(arrival_time_s=1.0, token_times_s=[1.1, 1.3, 1.6], finish_time_s=1.7)
    record = slo.record_from_metrics(metrics)
    assert record.ttft_s == pytest.approx(metrics.ttft_s)
    assert record.e2e_s == pytest.approx(metrics.e2e_s)
    assert record.itl_s == pytest.approx(metrics.itl_s)
    assert record.tpot_s == pytest.approx((1.7 - 1.1) / 2)


def test_records_from_outputs_count_only_whole_answers_as_ok():
    """A request stopped at its deadline or by an error did not answer its user: it is a failure."""
    from types import SimpleNamespace

    metrics = RequestMetrics(arrival_time_s=0.0, token_times_s=[0.1, 0.2], finish_time_s=0.3)

    def output(reason, finished=True):
        return SimpleNamespace(
            metrics=metrics, finished=finished, finish_reason=reason, prompt_token_ids=[1, 2], request_id=reason
        )

    reasons = ["stop", "length", "deadline", "error", "cancelled", None]
    outputs = [output(r) for r in reasons[:-1]] + [output(None, finished=False)]
    statuses = [r.status for r in slo.records_from_outputs(outputs)]
    assert statuses == ["ok", "ok", "failed", "failed", "cancelled", "failed"]


def test_records_reject_bad_input():
    with pytest.raises(ValueError, match="backwards"):
        RequestRecord(1.0, [0.5])
    with pytest.raises(ValueError, match="backwards"):
        RequestRecord(0.0, [0.5, 0.4])
    with pytest.raises(ValueError, match="status"):
        RequestRecord(0.0, [0.1], status="timeout")
    with pytest.raises(ValueError, match="positive"):
        SLO(ttft_s=0)
    with pytest.raises(ValueError, match="availability"):
        SLO(availability=1.5)


# --- percentiles and the summary table ---------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 95, 99, 99.9, 100])
def test_percentile_matches_numpy(q):
    rng = random.Random(q)
    for n in (1, 2, 7, 100):
        values = [rng.lognormvariate(0, 1) for _ in range(n)]
        assert slo.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert math.isnan(slo.percentile([], 50))
    with pytest.raises(ValueError):
        slo.percentile([1.0], -1)
    values = [3.0, 1.0, 2.0]
    assert slo.percentile(values, 50) == 2.0 and values == [3.0, 1.0, 2.0]


def test_summary_table_shape_and_values():
    records = [_steady(i, 0.1 * (i + 1), 0.02, 5) for i in range(10)]
    table = slo.summary_table(records)
    assert list(table.index) == ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"]
    assert list(table.columns) == ["count", "mean", "p50", "p90", "p95", "p99"]
    ttfts_ms = [100.0 * (i + 1) for i in range(10)]
    assert table.loc["ttft_ms", "p90"] == pytest.approx(float(np.percentile(ttfts_ms, 90)))
    assert table.loc["ttft_ms", "mean"] == pytest.approx(550.0)
    assert table.loc["itl_ms", "count"] == 40  # 4 gaps per request
    assert table.loc["tpot_ms", "p50"] == pytest.approx(20.0)
    row = table.loc["e2e_ms"]
    assert row["p50"] <= row["p90"] <= row["p95"] <= row["p99"]


def test_summary_table_of_an_empty_run():
    table = slo.summary_table([])
    assert list(table["count"]) == [0, 0, 0, 0]
    assert table["p99"].isna().all()


def test_latency_distributions_leave_out_failures():
    records = [_steady(0, 0.1, 0.01, 3), _steady(0, 9.0, 0.01, 3, status="failed")]
    assert slo.metric_values_s(records, "ttft") == pytest.approx([0.1])
    with pytest.raises(ValueError, match="unknown metric"):
        slo.metric_values_s(records, "latency")


def test_slo_is_importable_without_pandas():
    code = "import sys; sys.modules['pandas'] = None; import minserve.slo; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


# --- attainment and goodput --------------------------------------------------------------------------------

CHAT = SLO("chat", ttft_s=0.5, tpot_s=0.05)


def _mixed_run() -> list[RequestRecord]:
    return [
        _steady(0.0, 0.1, 0.02, 10),  # good
        _steady(1.0, 0.9, 0.02, 10),  # misses TTFT
        _steady(2.0, 0.1, 0.09, 10),  # misses TPOT
        _steady(3.0, 0.1, 0.02, 1),  # one token: good
        _steady(4.0, 0.1, 0.02, 10, status="failed"),  # fast, but failed
        _steady(5.0, 0.1, 0.02, 3, status="cancelled"),  # fast, but the client left
    ]


def test_attainment_counts_every_request():
    result = slo.attainment(_mixed_run(), CHAT)
    assert result == pytest.approx({"ttft": 3 / 6, "tpot": 3 / 6, "all": 2 / 6})


def test_goodput_counts_failures_and_cancellations_against():
    records = _mixed_run()
    window = slo.window_s(records)
    assert window == pytest.approx(5.0 + 0.1 + 2 * 0.02)  # first arrival → last finish
    assert slo.goodput_rps(records, CHAT) == pytest.approx(2 / window)
    assert slo.goodput_rps(records, CHAT, window=10.0) == pytest.approx(0.2)
    assert slo.request_throughput_rps(records, window=10.0) == pytest.approx(0.4)  # 4 finished ok
    assert slo.token_throughput_tps(records, window=10.0) == pytest.approx(3.1)  # 10 + 10 + 10 + 1 tokens


def test_goodput_never_exceeds_throughput():
    rng = random.Random(3)
    for _ in range(30):
        records = [
            _steady(i, rng.uniform(0, 1), rng.uniform(0, 0.1), rng.randint(1, 9), rng.choice(slo.STATUSES))
            for i in range(20)
        ]
        assert 0 <= slo.goodput_rps(records, CHAT) <= slo.request_throughput_rps(records)


def test_empty_run():
    assert all(math.isnan(v) for v in slo.attainment([], CHAT).values())
    assert slo.goodput_rps([], CHAT) == 0.0
    assert slo.window_s([]) == 0.0
    assert math.isnan(slo.availability([]))
    report = slo.evaluate([], CHAT, usd_per_accelerator_hour=2.0)
    assert report.requests == 0 and report.usd_per_million_tokens == math.inf


def test_a_looser_contract_attains_at_least_as_much():
    loose = SLO("batch", ttft_s=5.0, tpot_s=0.5)
    assert loose.is_looser_than(CHAT) and not CHAT.is_looser_than(loose)
    assert not SLO(e2e_s=100.0).is_looser_than(CHAT)  # a target chat does not set is not "looser"
    rng = random.Random(5)
    records = [_steady(i, rng.uniform(0, 2), rng.uniform(0, 0.2), rng.randint(1, 20)) for i in range(50)]
    assert slo.attainment(records, loose)["all"] >= slo.attainment(records, CHAT)["all"]


def test_max_itl_target_catches_a_stall_the_average_hides():
    stall = RequestRecord(0.0, [0.1, 0.11, 0.12, 0.13, 0.63, 0.64])  # one 500 ms gap
    assert slo.meets(stall, SLO(tpot_s=0.15))["all"]
    assert not slo.meets(stall, SLO(tpot_s=0.15, max_itl_s=0.2))["all"]


# --- availability, error budget, cost ----------------------------------------------------------------------


def test_availability_over_a_window_leaves_out_cancellations():
    records = [_steady(float(i), 0.1, 0.01, 2, "failed" if i in (2, 7) else "ok") for i in range(10)]
    records.append(_steady(3.5, 0.1, 0.01, 2, "cancelled"))
    assert slo.availability(records) == pytest.approx(8 / 10)
    assert slo.availability(records, start_s=0.0, end_s=5.0) == pytest.approx(4 / 5)
    assert slo.availability(records, start_s=8.0) == pytest.approx(1.0)


def test_error_budget():
    records = [_steady(float(i), 0.1, 0.01, 2, "failed" if i < 3 else "ok") for i in range(1000)]
    budget = slo.error_budget(records, target=0.995)
    assert budget.allowed_failures == pytest.approx(5.0)
    assert budget.failures == 3
    assert budget.remaining == pytest.approx(0.4)
    overspent = slo.error_budget(records, target=0.999)
    assert overspent.remaining == pytest.approx(1 - 3 / 1.0)
    assert slo.error_budget(records[3:], target=1.0).remaining == 1.0
    assert slo.error_budget(records, target=1.0).remaining == -math.inf


def test_cost_per_million_tokens():
    # $2 per hour at 1000 tokens/s: 3.6 M tokens per hour → $0.556 per million.
    assert slo.cost_per_million_tokens(2.0, 1000.0) == pytest.approx(2.0 / 3.6)
    assert slo.cost_per_million_tokens(2.0, 1000.0, accelerators=8) == pytest.approx(8 * 2.0 / 3.6)
    assert slo.cost_per_million_tokens(2.0, 500.0) == pytest.approx(2 * slo.cost_per_million_tokens(2.0, 1000.0))
    assert slo.cost_per_million_tokens(2.0, 0.0) == math.inf
    with pytest.raises(ValueError):
        slo.cost_per_million_tokens(-1.0, 10.0)


def test_evaluate_row():
    report = slo.evaluate(_mixed_run(), CHAT, window=10.0, usd_per_accelerator_hour=3.6)
    row = report.as_row()
    assert row["contract"] == "chat" and row["requests"] == 6
    assert row["attainment_all"] == pytest.approx(2 / 6)
    assert row["goodput_rps"] == pytest.approx(0.2)
    assert row["availability"] == pytest.approx(4 / 5)
    assert row["usd_per_million_tokens"] == pytest.approx(3.6 / 3600 / 3.1 * 1e6)


def test_summarize_is_one_key_scheme_for_the_simulator_and_the_load_tester():
    """Distributions nest under their metric; the load tester's summary is this one plus its own extras."""
    from minserve.bench.arrivals import OpenLoop
    from minserve.bench.client import RequestResult
    from minserve.bench.metrics import summarize as bench_summarize
    from minserve.bench.metrics import to_slo_record
    from minserve.bench.runner import RunResult

    results = [
        RequestResult(i, float(i), float(i), [i + 0.1, i + 0.11, i + 0.12], i + 0.12, output_tokens=3) for i in range(4)
    ]
    run = RunResult("rate=1", OpenLoop(1.0), results, duration_s=4.0)
    summary = slo.summarize([to_slo_record(r) for r in results], CHAT, window=4.0)
    assert set(summary["ttft_ms"]) == {"count", "mean", "p50", "p90", "p95", "p99"}
    assert slo.lookup(summary, "ttft_ms.p50") == pytest.approx(100.0)
    assert summary["request_throughput_rps"] == pytest.approx(1.0) and summary["attainment"]["all"] == 1.0
    bench = bench_summarize(run, CHAT)
    # One chunk per token here, so the chunks' gaps (the load tester's ITL) are the tokens' gaps.
    assert {key: bench[key] for key in summary} == summary
    assert {"label", "errors", "client_lag_ms", "verdict"} <= set(bench) - set(summary)  # only extras added

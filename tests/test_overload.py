"""Chapter 09's experiments (minserve.bench.overload) against a real server on loopback: a short overload where
every request is accounted for, by the client and by the server's /metrics alike; a retry storm whose counts
add up, and in which naive retries send more than jittered, budgeted ones. Then the bookkeeping on synthetic
records: outcomes, the buckets /metrics is compared in, and the recovery time. Last, the finish rate that
deadline-aware admission predicts slot waits from, which must not promise more than the engine delivers."""

from __future__ import annotations

import json
import math

import pytest

from minserve import slo
from minserve.bench.client import ClientConfig, RequestResult
from minserve.bench.overload import (
    OUTCOMES,
    OVERLOAD_COLUMNS,
    STORM_COLUMNS,
    STORM_SUMMARY_COLUMNS,
    AttemptRecord,
    StormRun,
    StormShape,
    client_buckets,
    measure_capacity,
    outcome_of,
    overload_table,
    recovery_s,
    run_overload,
    run_retry_storm,
    server_buckets,
    storm_summary,
    storm_table,
)
from minserve.bench.workload import LengthDist, WorkloadSpec
from minserve.config import ServerConfig
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.service_rates import ServiceRateMeter
from minserve.engine.step_report import ScheduledSeq, StepReport
from tests.servers import MODEL, RunningServer

WORKLOAD = WorkloadSpec(8, LengthDist("fixed", 16), LengthDist("fixed", 32), seed=1)


@pytest.fixture(scope="module")
def server():
    """Two slots and a queue of two: a few requests at once are an overload."""
    running = RunningServer(ServerConfig(max_waiting_requests=2), num_kv_blocks=64, max_num_seqs=2)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> ClientConfig:
    return ClientConfig(server.url, MODEL, ignore_eos=True, timeout_s=60)


# Far over what two slots can serve (a request makes 32 decode steps of some milliseconds each), on any
# machine: the overload does not hang on a capacity measured while other tests share the cores.
OVER_CAPACITY_RPS = 30.0


def test_capacity_is_measured_on_a_closed_loop(client):
    capacity = measure_capacity(client, WORKLOAD, concurrency=2, num_requests=2)
    assert 0 < capacity < math.inf


def test_every_request_of_an_overload_is_accounted_for_by_client_and_server(client):
    contract = slo.SLO(ttft_s=1.0)
    runs = run_overload(client, WORKLOAD, OVER_CAPACITY_RPS / 3, (3,), duration_s=1.5, contract=contract)
    (run,) = runs
    counts = run.counts()
    assert sum(counts.values()) == len(run.run.results) == round(OVER_CAPACITY_RPS * 1.5)
    assert counts["refused"] > 0, "30 requests/s into two slots and a queue of two must refuse some"
    assert counts["succeeded"] > 0
    assert run.server is not None
    assert server_buckets(run.server) == client_buckets(run.run.results)  # none lost on either side
    table = overload_table(runs)
    assert tuple(table.columns) == OVERLOAD_COLUMNS
    row = table.iloc[0]
    assert row.sent == row.succeeded + row.refused + row.timed_out + row.failed
    assert bool(row.server_accounted)
    assert 0 <= row.attainment_all <= row.attainment_admitted <= 1
    assert 0 < row.refusal_p50_s <= row.refusal_p99_s < 30  # generous: a refusal does not wait for a slot


def test_a_deadline_sent_with_each_request_makes_client_and_server_agree_on_timeouts(server):
    """With two clocks (the client's timeout, the server's), a request can finish on the server just as the
    client gives up on it; with the deadline sent, the server's 504 decides, and both count the same."""
    hasty = ClientConfig(server.url, MODEL, ignore_eos=True, timeout_s=0.3, send_deadline=True)
    long_outputs = WorkloadSpec(4, LengthDist("fixed", 16), LengthDist("fixed", 256), seed=2)
    (run,) = run_overload(hasty, long_outputs, 4.0, (1,), duration_s=1.0, contract=slo.SLO(ttft_s=1.0))
    timed_out = [r for r in run.run.results if outcome_of(r) == "timed_out"]
    assert timed_out, "256 tokens do not decode in 0.3 s"
    assert all(r.error != "timeout" for r in timed_out), "the server stopped them, not the client's clock"
    assert server_buckets(run.server) == client_buckets(run.run.results)


def test_storm_counts_add_up_and_naive_retries_send_more_than_jitter_with_a_budget(client):
    shape = StormShape(OVER_CAPACITY_RPS / 4, spike_multiple=4, spike_s=1.0, before_s=0.3, after_s=0.5)
    runs = [run_retry_storm(client, strategy, WORKLOAD, shape, max_attempts=3, base_s=0.1, cap_s=0.5)
            for strategy in ("naive", "jitter+budget")]  # fmt: skip
    for run in runs:  # the same requests, each attempt logged once, each result from its last attempt
        assert len(run.results) == len(shape.timetable())
        assert sum(r.attempts for r in run.results) == len(run.attempts)
        assert all(1 <= r.attempts <= 3 for r in run.results)
        succeeded = sum(outcome_of(r) == "succeeded" for r in run.results)
        assert succeeded == sum(a.outcome == "succeeded" for a in run.attempts)
        table = storm_table([run], bin_s=0.5)
        assert tuple(table.columns) == STORM_COLUMNS
        assert round(table.attempts_per_s.sum() * 0.5) == len(run.attempts)
        assert round(table.successes_per_s.sum() * 0.5) == succeeded
    summary = storm_summary(runs)
    assert tuple(summary.columns) == STORM_SUMMARY_COLUMNS
    attempts = dict(zip(summary.strategy, summary.attempts))
    assert attempts["naive"] > len(runs[0].results), "the spike was refused, and the naive client retried"
    assert attempts["naive"] > attempts["jitter+budget"]


# --- bookkeeping, on synthetic records ---------------------------------------------------------------------


def result(status="ok", error=None, message=None) -> RequestResult:
    return RequestResult(0, 0.0, status=status, error=error, error_message=message)


def test_each_way_a_request_ends_is_one_outcome():
    server_timeout = json.dumps({"message": "took too long", "code": "timeout", "type": "timeout"})
    engine_error = json.dumps({"message": "core died", "code": "engine_error", "type": "server_error"})
    cases = {
        "succeeded": [result()],
        "cancelled": [result("cancelled")],
        "refused": [result("failed", "http_429")],
        "timed_out": [
            result("failed", "timeout"),
            result("failed", "http_504"),
            result("failed", "server_error", server_timeout),
        ],
        "failed": [
            result("failed", "server_error", engine_error),
            result("failed", "connection"),
            result("failed", "http_500"),
        ],
    }
    assert set(cases) == set(OUTCOMES)
    for outcome, results in cases.items():
        assert [outcome_of(r) for r in results] == [outcome] * len(results)


def test_the_client_and_server_buckets_disagree_when_a_request_is_missing():
    results = [result(), result(), result("failed", "http_429"), result("cancelled"), result("failed", "timeout")]
    delta = {
        'request_success_total{finished_reason="length"}': 2.0,
        'request_success_total{finished_reason="abort"}': 2.0,
        'requests_rejected_total{reason="queue_full"}': 1.0,
    }
    assert server_buckets(delta) == client_buckets(results)
    assert server_buckets(delta) != client_buckets(results[1:])  # one success the client lost
    assert server_buckets(delta) != client_buckets(results[:-1])  # one timeout the client did not record


def storm(refusal_bins: list[int], spike_end_s: float, bin_s: float = 1.0) -> StormRun:
    """A storm with one refused attempt ending in each listed bin and one success in every bin."""
    attempts = [AttemptRecord(i * bin_s, i * bin_s + 0.5, "succeeded") for i in range(10)]
    attempts += [AttemptRecord(i * bin_s, i * bin_s + 0.5, "refused") for i in refusal_bins]
    shape = StormShape(1.0, spike_s=spike_end_s, before_s=0.0)
    return StormRun("naive", shape, [], attempts, duration_s=10 * bin_s)


def test_recovery_ends_with_the_last_bin_of_refusals_after_the_spike():
    assert recovery_s(storm([1, 2, 3, 5], spike_end_s=3.0), bin_s=1.0) == 3.0  # bin 5 ends at 6 s
    assert recovery_s(storm([1, 2], spike_end_s=3.0), bin_s=1.0) == 0.0
    assert recovery_s(storm([1, 9], spike_end_s=3.0), bin_s=1.0) == math.inf  # still refusing at the end


# --- the finish rate deadline admission reads (minserve.engine.service_rates) ------------------------------


def decode_step(num_finished: int, step_s: float = 0.05) -> StepReport:
    finished = [RequestOutput(f"r{i}", None, [1], "", [2], "length", RequestMetrics(0.0)) for i in range(num_finished)]
    return StepReport(1, 0.0, 0.0, step_s, step_s, [ScheduledSeq("r", 1, 0, "decode")], [], [], 0, [], [], 16,
                      outputs=finished)  # fmt: skip


def test_the_finish_rate_is_not_set_by_the_first_burst_of_finishes():
    meter = ServiceRateMeter()
    for _ in range(39):
        meter(decode_step(0))
    assert meter.rates.finished_per_s is None  # nothing finished yet: no rate
    meter(decode_step(16))  # 16 requests in 40 steps of 0.05 s: 8 requests/s
    assert 0 < meter.rates.finished_per_s < 2 * 8.0


def test_the_finish_rate_averages_over_bursts_of_requests_that_finish_together():
    """16 requests admitted together finish together every 40 steps: 8 requests/s, in bursts. Read right
    after a burst (when admission admits most), the rate may not promise much more than that."""
    meter, highest = ServiceRateMeter(), 0.0
    for step in range(400):
        meter(decode_step(16 if step % 40 == 39 else 0))
        highest = max(highest, meter.rates.finished_per_s or 0.0)
    assert 8.0 < highest < 2 * 8.0

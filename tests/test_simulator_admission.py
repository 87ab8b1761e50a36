"""Admission control in the simulator: the server's policies decide each simulated arrival from the queue the
server would see, and chapter 09's overload sweep shows what that buys at three times the capacity."""

from __future__ import annotations

import math

import pytest

from minserve import slo
from minserve.admission import AdmissionPolicy, DeadlineAware, QueueLength, QueueState, Refusal
from minserve.capacity import experiments
from minserve.capacity.experiments import NO_ADMISSION, OVERLOAD_COLUMNS, OVERLOAD_SLO, overload_sweep
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator, StepCostModel, make_requests, simulate
from minserve.engine.service_rates import PRIOR, ServiceRates
from minserve.engine.step_report import EngineStats

SIMPLE = StepCostModel({"base": 0.010, "prefill_tokens": 0.001, "decode_seqs": 0.002})


class RefuseAll(AdmissionPolicy):
    def decide(self, request, queue):
        return Refusal("closed", 2.5, "closed for the test")


class Recorder(AdmissionPolicy):
    """Admits everything, and keeps each decision's queue with the virtual time it was made at."""

    def __init__(self, simulator: Simulator) -> None:
        self.simulator, self.seen = simulator, []

    def decide(self, request, queue):
        self.seen.append((self.simulator.core.clock.now(), queue))
        return None


def _requests(n: int = 40, gap_s: float = 0.05) -> list[SimRequest]:
    return make_requests([i * gap_s for i in range(n)], [20 + 7 * (i % 5) for i in range(n)], 6, seed=1)


def test_a_policy_that_refuses_everything_refuses_everything():
    requests = _requests()
    result = simulate(requests, SIMPLE, admission=RefuseAll())
    assert len(result.refused) == len(requests) and result.admitted == [] and result.steps == []
    for request, out in zip(requests, result.requests):
        assert out.refusal == Refusal("closed", 2.5, "closed for the test") and out.finish_reason == "refused"
        assert out.output_tokens == 0 and out.metrics.token_times_s == []
        assert out.metrics.arrival_time_s == out.metrics.finish_time_s == request.arrival_s
    target = slo.SLO(ttft_s=10.0)
    summary = result.summary(target)
    assert (summary["refused"], summary["failed"], summary["ok"]) == (len(requests), len(requests), 0)
    assert summary["goodput_rps"] == 0.0 and summary["attainment"]["all"] == 0.0


def test_refused_requests_count_against_goodput_and_the_admitted_run_as_before():
    """Refuse every other request: the rest are served exactly as they are alone, and the refused never meet the
    SLO (a refusal is a failed request, not a missing one)."""

    class EveryOther(AdmissionPolicy):
        def decide(self, request, queue):
            self.count = getattr(self, "count", 0) + 1
            return Refusal("odd", 1.0, "odd one out") if self.count % 2 == 0 else None

    requests = _requests()
    result = simulate(requests, SIMPLE, admission=EveryOther())
    kept = simulate(requests[::2], SIMPLE)
    assert [r.request_id for r in result.admitted] == [r.request_id for r in kept.requests]
    assert [r.metrics.token_times_s for r in result.admitted] == [r.metrics.token_times_s for r in kept.requests]
    assert [r.request_id for r in result.refused] == [r.request_id for r in requests[1::2]]
    loose = slo.SLO(ttft_s=100.0)
    assert slo.attainment(result.records, loose)["all"] == pytest.approx(0.5)
    assert sum(slo.meets(r, loose)["all"] for r in result.records) == len(kept.requests)


def test_the_queue_the_simulator_shows_the_policy_matches_the_core():
    """At each arrival: the requests still in the core (admitted before, not finished yet) and, of those, the
    prompt tokens of the ones with no first token yet, counted independently from the run's own timestamps;
    the rates measured from the steps that have ended, by the engine's meter."""
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    simulator = Simulator(SIMPLE, config)
    simulator.admission = recorder = Recorder(simulator)
    requests = _requests()
    result = simulator.run(requests)
    assert len(recorder.seen) == len(requests)
    for index, (now, queue) in enumerate(recorder.seen):
        earlier = result.requests[:index]  # all admitted, in arrival order
        in_core = [r for r in earlier if r.metrics.finish_time_s > now]
        no_token = [r for r in in_core if r.metrics.token_times_s[0] > now]
        assert queue.num_requests == len(in_core) and queue.num_running <= 3
        assert queue.queued_prompt_tokens == sum(r.prompt_tokens for r in no_token)
        assert queue.max_num_seqs == 3 and 0 <= queue.kv_usage <= 1
        ended = [s for s in result.steps if s.start_s + s.duration_s <= now]
        assert queue.rates.num_steps == len(ended)
        if not ended:
            assert queue.rates == PRIOR
    assert recorder.seen[-1][1].rates.prefill_tokens_per_s != PRIOR.prefill_tokens_per_s  # measured by then


def test_queue_state_of_counts_is_the_one_rule():
    stats = EngineStats(kv_blocks_total=200, kv_blocks_used=50, kv_cache_bytes=0, prefix_cache_hit_rate=0.0,
                        num_preemptions=0, num_running=4, num_waiting=7)  # fmt: skip
    rates = ServiceRates(500.0, 0.02)
    assert QueueState.of_counts(stats, 300, rates, 8) == QueueState(7, 4, 300, rates, 0.25, 8)
    empty = EngineStats(0, 0, 0, 0.0, 0, 0, 0)
    assert QueueState.of_counts(empty, 0, rates, None).kv_usage == 0.0


@pytest.fixture(scope="module")
def sweep():
    policies = {"none": QueueLength(NO_ADMISSION), "deadline": DeadlineAware(0.5 * OVERLOAD_SLO.ttft_s)}
    return overload_sweep(policies=policies, load_multiples=(1.0, 3.0), num_requests=300)


def test_the_overload_sweep_has_the_chapters_columns_and_accounts_for_every_request(sweep):
    assert [(row["policy"], row["load_multiple"]) for row in sweep] == [
        ("none", 1.0), ("deadline", 1.0), ("none", 3.0), ("deadline", 3.0)
    ]  # fmt: skip
    for row in sweep:
        assert tuple(row) == OVERLOAD_COLUMNS
        assert row["sent"] == 300 == row["admitted"] + row["refused"]
        assert row["offered_rps"] == pytest.approx(row["load_multiple"] * row["capacity_rps"])
        assert row["met_slo"] <= row["admitted"] and row["timed_out"] == 0
        assert row["attainment_all"] == pytest.approx(row["met_slo"] / row["sent"])
        assert row["refusal_share"] == pytest.approx(row["refused"] / row["sent"])
    assert len({row["capacity_rps"] for row in sweep}) == 1


def test_deadline_aware_admission_keeps_the_admitted_inside_the_slo_at_three_times_capacity(sweep):
    """Would fail if the simulator ignored the policy: both rows would be the same run."""
    none, deadline = (row for row in sweep if row["load_multiple"] == 3.0)
    target_s = OVERLOAD_SLO.ttft_s
    assert none["refused"] == 0 and none["ttft_p99_s"] > 3 * target_s
    assert deadline["refused"] > 0 and deadline["ttft_p99_s"] <= target_s
    assert deadline["attainment_admitted"] == 1.0
    assert deadline["goodput_rps"] > 0.8 * deadline["capacity_rps"] > 3 * none["goodput_rps"]


def test_a_request_timeout_stops_admitted_requests_late_and_is_deadline_awares_budget():
    rows = overload_sweep(
        policies={"none": None, "deadline": DeadlineAware(10.0)}, load_multiples=(3.0,), num_requests=200,
        timeout_s=1.0,
    )  # fmt: skip
    none, deadline = rows
    assert none["timed_out"] > 0 and none["refused"] == 0
    # The request's own 1 s timeout, not the policy's 10 s, is what deadline-aware admission aims at.
    assert deadline["refused"] > 0 and deadline["timed_out"] < none["timed_out"]
    assert not math.isnan(deadline["ttft_p99_s"])


def test_the_default_sweep_is_chapter_09s_lesson():
    assert set(experiments.overload_policies()) == {"no admission", "deadline-aware"}
    with pytest.raises(ValueError, match="ttft_s"):
        experiments.overload_policies(slo.SLO(tpot_s=0.1))

"""minserve.capacity.simulator and `minserve plan calibrate` / `plan simulate`: the real scheduler on a virtual
clock, hand-worked virtual time, policies, block accounting, the cost-model fit, calibration on the embedded
model, and the command line.

No test asserts a wall-clock threshold: the simulator's speed is checked by running a thousand requests, and
measured step times only for signs and orderings that hold by a wide margin.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from minserve import slo
from minserve.capacity import calibration, cost_model
from minserve.capacity import simulator as sim
from minserve.capacity.cost_model import StepCostModel, StepFeatures, StepSample
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator, make_requests
from minserve.cli import main
from minserve.engine.block_manager import BlockManager
from minserve.engine.scheduler import ScheduledBatch, Scheduler
from minserve.workload import parse_length, poisson_arrivals, timetable
from tests import stand_in

ZERO = StepCostModel({})
# Hand-workable: 10 ms a step, 1 ms a prompt token, 2 ms a decode sequence.
SIMPLE = StepCostModel({"base": 0.010, "prefill_tokens": 0.001, "decode_seqs": 0.002})
# About what minserve-tiny costs on one CPU thread, for realistic dynamics.
CPU_LIKE = StepCostModel(
    {
        "base": 2e-3,
        "prefill_tokens": 6e-5,
        "prefill_attention_pairs": 1.4e-7,
        "decode_seqs": 1.1e-4,
        "decode_context_tokens": 4.5e-7,
        "decode_padded_kv_tokens": 8e-7,
    }
)


def prompt(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# --- the real scheduler, the same decisions ------------------------------------------------------------------


def _stand_in_decisions(prompts, outputs, priorities, config: SchedulerConfig) -> list[tuple]:
    """What tests/stand_in.py's loop (the engine's bookkeeping without a model) schedules, step by step."""
    block_manager = BlockManager(
        config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.host_blocks
    )
    scheduler = Scheduler(
        block_manager,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        policy=config.scheduling_policy,
        enable_chunked_prefill=config.enable_chunked_prefill,
        preemption_mode=config.preemption_mode,
    )
    for i, (p, n, priority) in enumerate(zip(prompts, outputs, priorities)):
        scheduler.add(stand_in.make_sequence(i, list(p), n, priority))
    decisions = []
    while scheduler.has_unfinished():
        batch, _ = stand_in.step(scheduler)
        decisions.append(_decision(batch))
    block_manager.check_invariants([])
    return decisions


def _decision(batch: ScheduledBatch) -> tuple:
    return (
        tuple(seq.request_id for seq in batch.seqs),
        tuple(batch.num_new_tokens),
        tuple(seq.request_id for seq in batch.preempted),
    )


def _reported(report) -> tuple:
    """The same decision, as the engine core reports a step it ran."""
    return (
        tuple(s.request_id for s in report.scheduled),
        tuple(s.num_new_tokens for s in report.scheduled),
        tuple(report.preempted),
    )


@pytest.mark.parametrize("policy", ["fcfs", "priority", "spf", "static"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_with_zero_cost_it_makes_the_stand_ins_decisions(policy, chunked, preemption_mode):
    rng = np.random.default_rng(7)
    n = 24
    prompts = [prompt(int(rng.integers(3, 60)), start=100 * i + 1) for i in range(n)]
    outputs = rng.integers(1, 30, size=n).tolist()
    priorities = rng.integers(0, 3, size=n).tolist()
    # 24 blocks of 8 tokens for 24 requests of up to 90 tokens: preemptions are certain.
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=32,
        block_size=8,
        num_kv_blocks=24,
        scheduling_policy=policy,
        enable_chunked_prefill=chunked,
        preemption_mode=preemption_mode,
        num_cpu_blocks=12,
    )
    expected = _stand_in_decisions(prompts, outputs, priorities, config)
    requests = [
        SimRequest(0.0, p, o, priority=pr, request_id=str(i))
        for i, (p, o, pr) in enumerate(zip(prompts, outputs, priorities))
    ]
    seen = []
    result = Simulator(ZERO, config).run(requests, on_step=lambda step, report: seen.append(_reported(report)))
    assert seen == expected
    assert any(d[2] for d in seen) or policy == "static"  # memory is short: the scheduler preempted
    assert result.num_preemptions == sum(len(d[2]) for d in seen)
    assert [r.output_tokens for r in result.requests] == outputs
    assert all(r.metrics.token_times_s == [0.0] * r.output_tokens for r in result.requests)  # no time passes


# --- virtual time, worked by hand ----------------------------------------------------------------------------


def test_one_request_ttft_is_the_prefill_step_and_tpot_the_decode_step():
    result = Simulator(SIMPLE).run([SimRequest(1.0, prompt(100), output_tokens=5)])
    (r,) = result.requests
    record = r.record
    assert record.ttft_s == pytest.approx(0.010 + 100 * 0.001)  # one prefill step of 100 tokens
    assert record.tpot_s == pytest.approx(0.010 + 0.002)  # each decode step: base + one sequence
    assert record.e2e_s == pytest.approx(0.110 + 4 * 0.012)
    assert r.metrics.first_scheduled_time_s == 1.0 and r.metrics.queue_s == 0.0
    assert r.finish_reason == "length" and record.ok
    assert [s.start_s for s in result.steps] == pytest.approx([1.0, 1.11, 1.122, 1.134, 1.146])
    assert result.end_s == pytest.approx(1.158)


def test_a_request_arriving_during_a_step_waits_for_it_then_shares_the_next():
    a = SimRequest(0.0, prompt(100), output_tokens=3, request_id="a")
    b = SimRequest(0.05, prompt(10, start=500), output_tokens=2, request_id="b")
    c = SimRequest(10.0, prompt(20, start=900), output_tokens=1, request_id="c")  # long after: the clock jumps
    result = Simulator(SIMPLE).run([c, b, a])
    ra, rb, rc = result.requests  # in arrival order
    # Step 1 [0, 0.110]: a's 100-token prefill. b arrived at 0.05 and waits for the step to end.
    # Step 2 [0.110, 0.132]: a decodes, b's 10-token prompt: 0.010 + 10 × 0.001 + 0.002.
    # Step 3 [0.132, 0.146]: both decode: 0.010 + 2 × 0.002. Both finish.
    assert ra.metrics.token_times_s == pytest.approx([0.110, 0.132, 0.146])
    assert rb.metrics.token_times_s == pytest.approx([0.132, 0.146])
    assert rb.record.ttft_s == pytest.approx(0.082)
    assert rb.metrics.first_scheduled_time_s == pytest.approx(0.110)
    assert rb.metrics.waiting_s == pytest.approx(0.060)
    assert rc.record.ttft_s == pytest.approx(0.030) and rc.metrics.token_times_s == pytest.approx([10.030])
    assert len(result.steps) == 4


def test_chunked_prefill_splits_a_long_prompt_across_steps_within_the_budget():
    config = SchedulerConfig(max_num_batched_tokens=64)
    result = Simulator(SIMPLE, config).run([SimRequest(0.0, prompt(200), output_tokens=2)])
    assert [s.features.prefill_tokens for s in result.steps] == [64, 64, 64, 8, 0]
    assert result.requests[0].record.ttft_s == pytest.approx(4 * 0.010 + 200 * 0.001)
    unchunked = Simulator(SIMPLE, SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False))
    assert [s.features.prefill_tokens for s in unchunked.run([SimRequest(0.0, prompt(200), 2)]).steps] == [200, 0]


def test_deadline_stops_a_request_that_waits_too_long():
    # Static batching: b cannot join a's running batch, so it waits past its 50 ms deadline.
    config = SchedulerConfig(scheduling_policy="static")
    a = SimRequest(0.0, prompt(100), output_tokens=20, request_id="a")
    b = SimRequest(0.001, prompt(10, start=500), output_tokens=5, deadline_s=0.05, request_id="b")
    result = Simulator(SIMPLE, config).run([a, b])
    ra, rb = result.requests
    assert ra.finish_reason == "length" and rb.finish_reason == "deadline"
    assert rb.output_tokens == 0 and rb.record.status == "failed"
    assert rb.metrics.finish_time_s > 0.051 and rb.metrics.waiting_s == pytest.approx(rb.record.e2e_s)
    assert slo.attainment(result.records, slo.SLO(ttft_s=10))["all"] == 0.5
    result_bm = Simulator(SIMPLE, config)
    result_bm.run([a, b])
    assert result_bm.block_manager.num_used_blocks == 0


def test_max_model_len_ends_a_request_as_the_engine_does():
    result = Simulator(SIMPLE, SchedulerConfig(max_model_len=20)).run([SimRequest(0.0, prompt(15), output_tokens=50)])
    assert result.requests[0].output_tokens == 5 and result.requests[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        Simulator(SIMPLE, SchedulerConfig(max_model_len=20)).run([SimRequest(0.0, prompt(20), output_tokens=1)])
    with pytest.raises(ValueError, match="KV cache"):
        Simulator(SIMPLE, SchedulerConfig(num_kv_blocks=2, block_size=4)).run([SimRequest(0.0, prompt(5), 4)])


# --- policies change outcomes as they should -----------------------------------------------------------------


def _mixed_burst(n: int = 60, seed: int = 3) -> list[SimRequest]:
    """A burst of short and long prompts (every fourth is 900 tokens) arriving within a second."""
    rng = np.random.default_rng(seed)
    lengths = [900 if i % 4 == 0 else int(rng.integers(16, 64)) for i in range(n)]
    return make_requests(
        sorted(rng.uniform(0, 1.0, size=n)),
        lengths,
        32,
        seed=seed,
        priorities=[0 if i % 3 == 0 else 1 for i in range(n)],
    )


def _mean_ttft(result, which=lambda r: True) -> float:
    values = [r.record.ttft_s for r in result.requests if which(r)]
    return sum(values) / len(values)


def test_shortest_prompt_first_lowers_mean_ttft_against_fcfs():
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
    fcfs = sim.simulate(_mixed_burst(), CPU_LIKE, config)
    spf = sim.simulate(_mixed_burst(), CPU_LIKE, config, scheduling_policy="spf")
    assert _mean_ttft(spf) < 0.8 * _mean_ttft(fcfs)
    assert sum(r.output_tokens for r in spf.requests) == sum(r.output_tokens for r in fcfs.requests)


def test_priority_serves_the_urgent_first_and_static_batching_waits_longest():
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
    fcfs = sim.simulate(_mixed_burst(), CPU_LIKE, config)
    priority = sim.simulate(_mixed_burst(), CPU_LIKE, config, scheduling_policy="priority")
    urgent = lambda r: r.priority == 0  # noqa: E731
    assert _mean_ttft(priority, urgent) < _mean_ttft(fcfs, urgent)
    assert _mean_ttft(priority, urgent) < _mean_ttft(priority, lambda r: r.priority == 1)
    static = sim.simulate(_mixed_burst(), CPU_LIKE, config, scheduling_policy="static")
    assert _mean_ttft(static) > _mean_ttft(fcfs)


def test_more_load_means_more_queueing_until_throughput_saturates():
    lengths = np.random.default_rng(0).integers(16, 512, size=300).tolist()
    summaries = []
    for rate in (2, 8, math.inf):
        requests = make_requests(poisson_arrivals(300, rate, seed=1), lengths, 64)
        summaries.append(sim.simulate(requests, CPU_LIKE).summary())
    ttft = [s["ttft_ms"]["p50"] for s in summaries]
    assert ttft[0] < ttft[1] < ttft[2]
    assert summaries[0]["request_throughput_rps"] == pytest.approx(2, rel=0.3)
    assert summaries[2]["request_throughput_rps"] > summaries[1]["request_throughput_rps"]


# --- block accounting ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_blocks_are_all_returned_at_the_end(preemption_mode):
    requests = make_requests(
        poisson_arrivals(80, 50, seed=2),
        np.random.default_rng(2).integers(8, 120, 80).tolist(),
        40,
        shared_prefix_tokens=16,
    )
    simulator = Simulator(
        CPU_LIKE, SchedulerConfig(num_kv_blocks=40, block_size=8, preemption_mode=preemption_mode, num_cpu_blocks=20)
    )
    result = simulator.run(requests)
    assert result.num_preemptions > 0
    simulator.block_manager.check_invariants([])
    assert simulator.block_manager.num_used_blocks == 0
    assert len(simulator.block_manager.free_cpu_blocks) == simulator.block_manager.num_cpu_blocks
    assert not simulator.scheduler.has_unfinished()
    assert all(r.output_tokens == 40 and r.finish_reason == "length" for r in result.requests)
    assert sum(r.num_cached_tokens > 0 for r in result.requests) > 0  # the shared prefix hit the cache


def test_a_thousand_requests_run():
    n = 1000
    rng = np.random.default_rng(0)
    requests = make_requests(
        poisson_arrivals(n, 12, seed=0), rng.integers(16, 512, n).tolist(), rng.integers(16, 128, n).tolist()
    )
    result = sim.simulate(requests, CPU_LIKE)
    assert len(result.requests) == n and [r.request_id for r in result.requests] == [str(i) for i in range(n)]
    assert all(r.record.ok and r.output_tokens == req.output_tokens for r, req in zip(result.requests, requests))
    assert all(r.metrics.token_times_s == sorted(r.metrics.token_times_s) for r in result.requests)
    starts = [s.start_s for s in result.steps]
    assert starts == sorted(starts) and result.end_s >= starts[-1]
    summary = result.summary()
    assert summary["requests"] == summary["ok"] == n and summary["steps"] == len(result.steps)


# --- the cost model ------------------------------------------------------------------------------------------


def _synthetic_samples(true: dict[str, float], n: int, noise: float, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        decode = int(rng.integers(0, 64))
        prefill = int(rng.integers(0, 1024)) if rng.random() < 0.4 else 0
        context = decode * int(rng.integers(16, 800))
        features = StepFeatures(
            prefill_tokens=prefill,
            prefill_seqs=1 if prefill else 0,
            prefill_attention_pairs=prefill * (prefill + 1) // 2,
            decode_seqs=decode,
            decode_context_tokens=context,
            decode_padded_kv_tokens=int(context * 1.3),
        )
        if features.num_tokens == 0:
            continue
        time_s = StepCostModel(true).step_time_s(features) * (1 + noise * rng.standard_normal())
        samples.append(StepSample(features, time_s))
    return samples


TRUE = {
    "base": 2e-3,
    "prefill_tokens": 6e-5,
    "prefill_attention_pairs": 1.5e-7,
    "decode_seqs": 1e-4,
    "decode_context_tokens": 5e-7,
    "decode_padded_kv_tokens": 8e-7,
}


def test_fit_recovers_known_coefficients():
    exact = StepCostModel.fit(_synthetic_samples(TRUE, 400, noise=0.0))
    for name, value in TRUE.items():
        assert exact.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert exact.info["fit"]["median_relative_error"] < 1e-9
    noisy = StepCostModel.fit(
        _synthetic_samples(TRUE, 2000, noise=0.05, seed=1),
        terms=("base", "prefill_tokens", "prefill_attention_pairs", "decode_seqs", "decode_context_tokens"),
    )
    assert noisy.coefficients["base"] == pytest.approx(TRUE["base"], rel=0.1)
    assert noisy.coefficients["prefill_tokens"] == pytest.approx(TRUE["prefill_tokens"], rel=0.1)
    assert noisy.coefficients["decode_seqs"] == pytest.approx(TRUE["decode_seqs"], rel=0.2)


def test_fit_sets_aside_steps_another_process_slowed_and_keeps_coefficients_nonnegative():
    samples = _synthetic_samples(TRUE, 1000, noise=0.02, seed=2)
    slowed = [StepSample(s.features, s.time_s * 4) if i % 20 == 0 else s for i, s in enumerate(samples)]
    model = StepCostModel.fit(slowed)
    assert model.info["fit"]["set_aside"] >= len(samples) // 20
    assert model.coefficients["base"] == pytest.approx(TRUE["base"], rel=0.05)
    assert model.coefficients["prefill_tokens"] == pytest.approx(TRUE["prefill_tokens"], rel=0.05)
    # A term the data does not need comes out at zero, not negative.
    no_prefill = [s for s in samples if s.features.prefill_tokens == 0]
    model = StepCostModel.fit(no_prefill, terms=("base", "decode_seqs", "decode_context_tokens", "prefill_seqs"))
    assert all(value >= 0 for value in model.coefficients.values())


def test_cost_model_arithmetic_json_and_refusals(tmp_path):
    features = StepFeatures(prefill_tokens=100, prefill_seqs=1, decode_seqs=4)
    assert SIMPLE.step_time_s(features) == pytest.approx(0.010 + 0.1 + 0.008)
    assert SIMPLE.step_time_s(StepFeatures()) == 0.0  # a step that runs nothing costs nothing
    path = SIMPLE.save(tmp_path / "cost.json")
    assert StepCostModel.load(path) == SIMPLE
    assert json.loads(path.read_text())["format"] == cost_model.COST_FORMAT
    with pytest.raises(ValueError, match="step-cost"):
        StepCostModel.from_dict({"coefficients": {}})
    with pytest.raises(ValueError, match="unknown cost terms"):
        StepCostModel({"flops": 1.0})
    with pytest.raises(ValueError, match="≥ 0"):
        StepCostModel({"base": -1.0})
    with pytest.raises(FileNotFoundError):
        StepCostModel.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="cannot fit"):
        StepCostModel.fit([StepSample(features, 0.1)])


def test_step_features_count_what_the_attention_code_sees():
    block_manager = BlockManager(64, 4)
    scheduler = Scheduler(block_manager, max_num_seqs=8, max_num_batched_tokens=64)
    for i, (p, n) in enumerate([(10, 3), (6, 3)]):
        scheduler.add(stand_in.make_sequence(i, list(prompt(p, start=50 * i + 1)), n))
    first = scheduler.schedule()
    assert StepFeatures.of(first) == StepFeatures(
        prefill_tokens=16, prefill_seqs=2, prefill_attention_pairs=10 * 11 // 2 + 6 * 7 // 2
    )
    for seq, n in zip(first.seqs, first.num_new_tokens):
        seq.num_computed_tokens += n
        seq.output_token_ids.append(0)
    decode = StepFeatures.of(scheduler.schedule())
    assert (decode.decode_seqs, decode.decode_context_tokens, decode.decode_padded_kv_tokens) == (2, 11 + 7, 2 * 11)
    assert decode.prefill_tokens == 0 and decode.num_tokens == 2


# --- requests and arrivals -----------------------------------------------------------------------------------


def test_poisson_arrivals_are_the_load_testers_timetable():
    assert poisson_arrivals(50, 3.0, seed=4) == timetable(50, 3.0, "poisson", seed=4)
    assert poisson_arrivals(50, 3.0, seed=4, burstiness=0.5) == timetable(50, 3.0, "gamma", 0.5, seed=4)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0] and poisson_arrivals(0, 1.0) == []


def test_make_requests_and_sample_lengths():
    requests = make_requests([0.0, 1.0, 2.0], [10, 20, 5], 4, shared_prefix_tokens=8, seed=1)
    assert [r.prompt_tokens for r in requests] == [10, 20, 5]
    assert requests[0].prompt_token_ids[:8] == requests[1].prompt_token_ids[:8]
    assert requests[2].prompt_token_ids == requests[0].prompt_token_ids[:5]
    assert all(0 < t < 2048 for r in requests for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="prompt_lengths"):
        make_requests([0.0, 1.0], [10], 4)
    assert parse_length("7").sample(3) == [7, 7, 7]
    uniform = parse_length("uniform:100:50").sample(500, seed=1)
    assert min(uniform) >= 50 and max(uniform) <= 150 and 90 < np.mean(uniform) < 110
    assert 220 < np.mean(parse_length("lognormal:256:128").sample(4000)) < 290
    with pytest.raises(ValueError, match="length spec"):
        parse_length("normal:1:2").sample(3)


def test_sim_config_from_an_engine_and_its_json():
    config = SchedulerConfig(scheduling_policy="spf", preemption_mode="swap", num_kv_blocks=100)
    assert config.host_blocks == 100 and SchedulerConfig().host_blocks == 0
    assert SchedulerConfig.from_dict(config.to_dict()) == config
    assert SchedulerConfig.from_dict({**config.to_dict(), "future_knob": 1}, max_num_seqs=3).max_num_seqs == 3
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="fastest")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")


# --- calibration on the embedded model -----------------------------------------------------------------------

TINY_WORKLOAD = calibration.QUICK_WORKLOAD  # the one `minserve plan calibrate --quick` uses


@pytest.fixture(scope="module")
def llm():
    from minserve import LLM

    return LLM(enable_tracing=False, max_num_seqs=16, max_num_batched_tokens=256, num_threads=1)


def test_calibrate_on_the_embedded_model_gives_a_sane_fit(llm):
    cost = calibration.calibrate(llm, **TINY_WORKLOAD)
    c = cost.coefficients
    assert set(c) == set(cost_model.DEFAULT_TERMS[llm.engine.model.backend.name])
    assert all(value >= 0 for value in c.values()) and c["base"] > 0
    assert c["prefill_tokens"] > 0 or c["prefill_attention_pairs"] > 0
    fit = cost.info["fit"]
    assert fit["samples"] > 50 and fit["median_relative_error"] < 1.0  # loose: other processes share the CPU
    long_prefill = cost.step_time_s(StepFeatures(prefill_tokens=256, prefill_seqs=1, prefill_attention_pairs=32896))
    one_decode = cost.step_time_s(StepFeatures(decode_seqs=1, decode_context_tokens=64, decode_padded_kv_tokens=64))
    assert long_prefill > one_decode > 0
    assert cost.info["engine"] == SchedulerConfig.from_engine(llm).to_dict()
    assert cost.info["engine"]["max_num_batched_tokens"] == 256
    assert "schedule" not in vars(llm.engine.core.scheduler)  # the wrapper is gone
    assert not llm.engine.has_unfinished_requests()
    # The calibrated model drives the simulator.
    requests = make_requests(poisson_arrivals(20, 5, seed=0), 64, 8)
    assert sim.simulate(requests, cost, SchedulerConfig.from_engine(llm)).summary()["ok"] == 20


def test_calibrate_refuses_a_busy_engine(llm):
    from minserve import SamplingParams

    request_id = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="in flight"):
            calibration.measure_steps(llm, **TINY_WORKLOAD)
    finally:
        llm.cancel(request_id)
        llm.engine.process_aborts()


# --- the command line ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["calibrate", "simulate"])
def test_plan_kinds_have_help(kind, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", kind, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: minserve plan {kind}" in out and "--max-num-seqs" in out


def test_plan_calibrate_then_simulate(tmp_path, capsys):
    cost_path = tmp_path / "cost.json"
    argv = ["plan", "calibrate", "--quick", "--threads", "1", "--max-num-seqs", "16", "--out", str(cost_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ms per step" in out and f"wrote {cost_path}" in out
    cost = StepCostModel.load(cost_path)
    assert cost.info["engine"]["max_num_seqs"] == 16 and cost.info["threads"] == 1
    out_json = tmp_path / "sim.json"
    argv = [
        "plan",
        "simulate",
        "--cost",
        str(cost_path),
        "--rates",
        "2,inf",
        "--num-prompts",
        "40",
        "--slo-ttft-ms",
        "500",
        "--scheduling-policy",
        "spf",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "policy spf, max_num_seqs 16" in out and "TTFT p50" in out
    runs = json.loads(out_json.read_text())["runs"]
    assert [run["rate_rps"] for run in runs] == [2.0, None] and all(run["ok"] == 40 for run in runs)
    assert 0 <= runs[0]["goodput_rps"] <= runs[0]["request_throughput_rps"]


def test_plan_simulate_bad_input_exits_with_a_message(tmp_path, capsys):
    assert main(["plan", "simulate", "--cost", str(tmp_path / "none.json")]) == 2
    assert "plan calibrate" in capsys.readouterr().err
    cost_path = SIMPLE.save(tmp_path / "cost.json")
    assert main(["plan", "simulate", "--cost", str(cost_path), "--rates", "0"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert main(["plan", "simulate", "--cost", str(cost_path), "--prompt-len", "big"]) == 2
    assert "length spec" in capsys.readouterr().err


def test_sim_config_refuses_a_context_too_short_to_generate():
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=1)

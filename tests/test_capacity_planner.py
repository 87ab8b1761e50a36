"""minserve.capacity.planner, roofline_cost and confirmation, `minserve plan capacity`, and the lab's capacity
planner: the envelope's arithmetic on hand-worked cases, the rate search on a simulator whose capacity is
known exactly, the roofline-backed step cost against the roofline itself, and the command line.

No test asserts a wall-clock threshold; the engine test asserts only what holds whatever the machine's load.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from minserve import slo
from minserve.capacity import envelope, planner
from minserve.capacity.cost_model import StepCostModel, StepFeatures
from minserve.capacity.planner import Machine, Workload
from minserve.capacity.roofline import hardware, predict_decode, predict_prefill
from minserve.capacity.roofline_cost import RooflineStepCost
from minserve.capacity.simulator import SchedulerConfig, Simulator, make_requests
from minserve.cli import main
from minserve.workload import LengthDist, parse_length

TEN_MS = StepCostModel({"base": 0.010})  # every step 10 ms, whatever it holds: capacities by hand
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


def fixed(tokens: int) -> LengthDist:
    return LengthDist("fixed", tokens)


# --- 1. concurrency ----------------------------------------------------------------------------------------


def test_kv_limited_concurrency_is_the_block_arithmetic():
    config = SchedulerConfig(num_kv_blocks=100, block_size=16)
    # 100 + 29 − 1 = 128 tokens of KV at the end (the last token is never stored) = 8 blocks: 100 // 8 = 12.
    assert planner.kv_limited_concurrency(config, 100, 29) == 12
    # A 64-token shared prefix is 4 full blocks held once; each sequence owns 128 − 64 = 64 tokens, 4 blocks.
    assert planner.kv_limited_concurrency(config, 100, 29, shared_prefix_tokens=64) == (100 - 4) // 4
    # A partial block is never shared, and without prefix caching nothing is.
    assert planner.kv_limited_concurrency(config, 100, 29, shared_prefix_tokens=70) == 24
    # 100 + 21 − 1 = 120 tokens: a 72-token prefix shares 64 (4 blocks), the other 56 are owned (4 blocks).
    assert planner.kv_limited_concurrency(config, 100, 21, shared_prefix_tokens=72) == (100 - 4) // 4
    assert planner.kv_limited_concurrency(config.replace(enable_prefix_caching=False), 100, 29, 64) == 12


@pytest.mark.parametrize("shared_prefix", [0, 64])
def test_kv_limited_concurrency_runs_without_preemption_and_one_more_does_not(shared_prefix):
    """The engine's own block manager (in the simulator) agrees: that many sequences of that length run side by
    side to their end without a preemption, one more forces one. A warm-up request first puts the shared
    prefix in the prefix cache, as a steady stream would."""
    config = SchedulerConfig(num_kv_blocks=100, block_size=16, max_num_seqs=1000, max_num_batched_tokens=10_000)
    fits = planner.kv_limited_concurrency(config, 100, 29, shared_prefix)

    def preemptions(n: int) -> int:
        requests = make_requests([0.0] + [1.0] * n, 100, [1] + [29] * n, seed=3, shared_prefix_tokens=shared_prefix)
        return Simulator(TEN_MS, config).run(requests).num_preemptions

    assert preemptions(fits) == 0
    assert preemptions(fits + 1) > 0


def test_budget_limited_concurrency():
    config = SchedulerConfig(max_num_batched_tokens=1000)
    # A seat held 10 steps carries 9 decodes and 91 prompt tokens: 10 tokens a step. 1000 / 10 = 100 seats.
    assert planner.budget_limited_concurrency(config, 91, 10) == 100
    assert planner.budget_limited_concurrency(config, 91, 10, cached_tokens=50) == int(1000 / 5)


# --- 2 and 3. throughput, and the highest rate meeting the SLO ----------------------------------------------


def constant_machine(seats: int = 8) -> Machine:
    return Machine("10 ms a step", TEN_MS, SchedulerConfig(max_num_seqs=seats))


def test_saturated_throughput_of_a_constant_step_cost_is_the_hand_count():
    # 8 seats, a token each per 10 ms step: 800 tokens/s; a request holds its seat 10 steps: 80 requests/s.
    workload = Workload(fixed(8), fixed(10), num_requests=400)
    ceiling = planner.saturated_throughput(constant_machine(8), workload)
    assert ceiling.output_tokens_per_s == pytest.approx(800, rel=0.01)
    assert ceiling.requests_per_s == pytest.approx(80, rel=0.01)
    assert ceiling.concurrency_seqs == pytest.approx(8, rel=0.01)
    assert ceiling.mean_step_s == pytest.approx(0.010)


def test_bisection_finds_the_knee_of_a_monotone_function():
    probed = []

    def meets(rate: float) -> bool:
        probed.append(rate)
        return rate <= 7.3

    found = planner.bisect_max_rate(meets, 0.1, 100.0, rel_tol=0.01)
    assert 7.3 / 1.01 <= found <= 7.3
    assert len(probed) < 15  # bisection, not a scan: log₂(log(1000) / log(1.01)) ≈ 9.4
    with pytest.raises(ValueError, match="low < high"):
        planner.bisect_max_rate(meets, 5.0, 1.0)


def test_the_rate_search_finds_the_capacity_of_a_constant_step_cost():
    """Constant arrivals below 80 requests/s never queue; above it request k waits k(1/80 − 1/λ), so with a
    100 ms TTFT bound for 99% of 1,000 requests the knee lies in [80, 80.5] (the 990th may wait 80 ms). The
    search is given a ceiling twice too high, so the bisection, not the ceiling, has to find it."""
    workload = Workload(fixed(8), fixed(10), num_requests=1000, arrival="constant")
    target = slo.SLO(ttft_s=0.1)
    search = planner.max_rate_meeting_slo(constant_machine(8), workload, target, 0.99, ceiling_rps=160.0)
    assert search.max_rate_rps == pytest.approx(80, rel=0.03)
    assert search.at_max_rate is not None and search.at_max_rate.meets_slo
    assert any(not p.meets_slo and p.rate_rps <= search.max_rate_rps * 1.021 for p in search.probes)


@pytest.mark.parametrize("target", [slo.SLO(ttft_s=0.001), slo.SLO(ttft_s=1.0, tpot_s=0.005)])
def test_an_slo_missed_at_light_load_has_no_rate(target):
    """Missed by every request even alone: TTFT under one step, or (every TTFT met) TPOT under one step: a
    request meets the SLO only when it meets every target."""
    workload = Workload(fixed(8), fixed(10), num_requests=50, arrival="constant")
    search = planner.max_rate_meeting_slo(constant_machine(), workload, target, 0.99, 80.0)
    assert search.max_rate_rps == 0 and search.at_max_rate is None and len(search.probes) == 1


# --- 4 and 5. Little's law, the queue ----------------------------------------------------------------------


def test_littles_law_on_a_known_case():
    """One request every 200 ms, each 10 steps of 10 ms: half the time one request is in the system."""
    assert envelope.littles_law_in_flight(5.0, 0.1) == pytest.approx(0.5)
    workload = Workload(fixed(8), fixed(10), num_requests=50, arrival="constant")
    probe = planner.probe_rate(constant_machine(), workload, slo.SLO(ttft_s=1.0), 0.99, 5.0)
    assert probe.mean_e2e_s == pytest.approx(0.1)
    result = Simulator(TEN_MS, constant_machine().config).run(workload.requests(5.0))
    batch = [s.features.prefill_seqs + s.features.decode_seqs for s in result.steps]  # what each step ran
    in_system_s = sum((ran + s.num_waiting) * s.duration_s for ran, s in zip(batch, result.steps))
    assert in_system_s / result.end_s == pytest.approx(envelope.littles_law_in_flight(5.0, probe.mean_e2e_s), rel=0.03)


class Times:
    def __init__(self, arrival_time_s: float, first_scheduled_time_s: float | None) -> None:
        self.arrival_time_s, self.first_scheduled_time_s = arrival_time_s, first_scheduled_time_s


def test_queue_found_on_arrival_counts_the_requests_not_yet_scheduled():
    metrics = [Times(0.0, 0.5), Times(0.1, 0.6), Times(0.2, 0.2), Times(0.7, 0.7), Times(0.8, None), Times(0.9, 1.0)]
    assert planner.queue_found_on_arrival(metrics) == [0, 1, 2, 0, 0, 1]
    assert planner.queue_found_on_arrival(list(reversed(metrics))) == [1, 0, 0, 2, 1, 0]  # in the order given
    # One scheduled at the very instant another arrives has left the queue (an idle engine takes both at once).
    assert planner.queue_found_on_arrival([Times(1.5, 2.0), Times(2.0, 2.0)]) == [0, 0]


# --- 6. replicas and cost ----------------------------------------------------------------------------------


def test_replicas_and_cost():
    assert envelope.replicas_for(20, 6) == 4
    assert envelope.replicas_for(20, 20 / 3) == 3
    assert envelope.replicas_for(20, 5) == 4 and envelope.replicas_for(0.5, 10) == 1
    assert envelope.replicas_for(2.1, 0.7) == 3  # 2.1 / 0.7 is 3.0000000000000004 in floating point
    deploy = envelope.deployment(20, 5, mean_output_tokens=100, usd_per_replica_hour=2.5)
    assert (deploy.replicas, deploy.usd_per_hour) == (4, 10.0)
    # $10 an hour for 20 × 100 tokens a second: 10 / 3600 / 2000 × 10⁶ dollars per million tokens.
    assert deploy.usd_per_million_output_tokens == pytest.approx(10 / 3600 / 2000 * 1e6)
    assert envelope.deployment(20, 5, 100).usd_per_hour is None
    with pytest.raises(ValueError, match="no rate meets the SLO"):
        envelope.replicas_for(20, 0.0)
    with pytest.raises(ValueError, match="target rate"):
        envelope.replicas_for(0, 5)


# --- the whole envelope --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_envelope() -> envelope.Envelope:
    machine = Machine("cpu-like", CPU_LIKE, SchedulerConfig(num_kv_blocks=512))
    workload = Workload(parse_length("lognormal:256:128"), parse_length("lognormal:64:32"), num_requests=200)
    return envelope.plan_capacity(machine, workload, slo.SLO(ttft_s=0.5, tpot_s=0.1), 0.95, 20.0, 2.5)


def test_the_envelope_holds_together(cpu_envelope):
    env = cpu_envelope
    probe = env.at_max_rate
    assert probe is not None and probe.attainment["all"] >= 0.95
    # This SLO holds up to the throughput ceiling, and the search never reaches it: there the queue grows.
    ceiling = env.throughput.requests_per_s
    assert ceiling / (1 + env.rel_tol) ** 2 <= env.max_rate_rps < ceiling
    assert max(p.rate_rps for p in env.probes) < ceiling and "throughput binds" in env.notes[0]
    assert env.kv_limited_concurrency_seqs == planner.kv_limited_concurrency(
        env.machine.config, math.ceil(env.workload.mean_prompt_tokens), math.ceil(env.workload.mean_output_tokens)
    )
    # The KV cache binds here: the saturated batch sits near its limit (lengths vary about the mean, and the
    # scheduler admits on the prompt alone), under max_num_seqs.
    assert env.binding_limit == "kv"
    assert 0.8 * env.kv_limited_concurrency_seqs <= env.throughput.concurrency_seqs <= env.machine.config.max_num_seqs
    assert env.in_flight_requests == pytest.approx(env.max_rate_rps * probe.mean_e2e_s)
    assert env.queue_limit_requests == math.ceil(probe.queue_found_requests)
    assert env.deployment.replicas == math.ceil(20.0 / env.max_rate_rps)
    quantities = [row["quantity"] for row in env.rows()]
    for expected in ("KV-limited concurrency", "sustainable throughput", "max rate meeting the SLO", "queue limit",
                     "replicas for the target", "cost per million output tokens"):  # fmt: skip
        assert expected in quantities


def test_a_stricter_slo_never_allows_a_higher_rate(cpu_envelope):
    env = cpu_envelope
    strict = envelope.plan_capacity(env.machine, env.workload, slo.SLO(ttft_s=0.2, tpot_s=0.05), 0.95, 20.0)
    assert strict.max_rate_rps <= env.max_rate_rps * (1 + env.rel_tol)
    assert strict.deployment is None or strict.deployment.replicas >= env.deployment.replicas


# --- the roofline as a step cost ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["Llama-3-8B", "Mixtral-8x7B"])
def test_the_roofline_step_cost_is_the_roofline(model):
    hw = hardware("H100")
    cost = RooflineStepCost(model, hw)
    prompt = 512
    alone = StepFeatures(prefill_tokens=prompt, prefill_seqs=1, prefill_attention_pairs=prompt * (prompt + 1) // 2)
    assert cost.step_time_s(alone) == pytest.approx(predict_prefill(model, prompt, hw).time_s, rel=1e-12)
    decodes = StepFeatures(decode_seqs=8, decode_context_tokens=8 * 1024)
    assert cost.step_time_s(decodes) == pytest.approx(predict_decode(model, 8, 1024, hw).time_s, rel=1e-12)
    mixed = StepFeatures(prefill_tokens=prompt, prefill_seqs=1, prefill_attention_pairs=alone.prefill_attention_pairs,
                         decode_seqs=8, decode_context_tokens=8 * 1024)  # fmt: skip
    assert cost.step_time_s(mixed) < cost.step_time_s(alone) + cost.step_time_s(decodes)  # one read of the weights
    assert RooflineStepCost(model, hw, step_overhead_s=0.002).step_time_s(decodes) == pytest.approx(
        cost.step_time_s(decodes) + 0.002
    )
    assert cost.step_time_s(StepFeatures()) == 0.0


def test_a_gpu_machine_holds_the_kv_blocks_that_fit_beside_the_weights():
    hw = hardware("H100")
    machine = planner.roofline_machine("Llama-3-8B", hw)
    # 0.9 × 80 GB − 16.06 GB of bf16 weights, in blocks of 16 tokens × 131,072 bytes.
    weights = 8_030_261_248 * 2
    assert machine.config.num_kv_blocks == (int(80e9 * 0.9) - weights) // (16 * 131_072)
    with pytest.raises(ValueError, match="no room for a KV cache"):
        planner.roofline_machine("Llama-3-70B", hardware("L4"))


# --- the command line --------------------------------------------------------------------------------------


def saved_cost(tmp_path, cost: StepCostModel = CPU_LIKE, **engine) -> str:
    info = {"model": "minserve-tiny", "device": "cpu", "engine": SchedulerConfig(**engine).to_dict()}
    return str(StepCostModel(cost.coefficients, info).save(tmp_path / "cost.json"))


def test_plan_capacity_prints_the_envelope(tmp_path, capsys):
    argv = ["plan", "capacity", "--cost", saved_cost(tmp_path, num_kv_blocks=512), "--num-prompts", "100",
            "--slo-ttft-ms", "500", "--slo-tpot-ms", "100", "--slo-attainment", "0.9", "--target-rate", "20",
            "--usd-per-hour", "2.5"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "minserve-tiny on this machine" in out and "TTFT ≤ 500 ms, TPOT ≤ 100 ms" in out
    quantities = ("KV-limited concurrency", "sustainable throughput", "max rate meeting the SLO",
                  "in flight (Little's law)", "queue limit", "replicas for the target", "cost per hour")  # fmt: skip
    for quantity in quantities:
        assert quantity in out


def test_plan_capacity_on_a_gpu_from_the_roofline(capsys):
    argv = ["plan", "capacity", "--gpu", "H100", "--model", "Llama-3-8B", "--num-prompts", "60",
            "--prompt-len", "512", "--output-len", "32", "--slo-ttft-ms", "200", "--max-num-seqs", "16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "H100 SXM (roofline, bfloat16)" in out and "max rate meeting the SLO" in out


def test_plan_capacity_writes_its_chart(tmp_path, capsys):
    plot = tmp_path / "knee.html"
    argv = ["plan", "capacity", "--cost", saved_cost(tmp_path, TEN_MS, max_num_seqs=8), "--num-prompts", "50",
            "--prompt-len", "8", "--output-len", "10", "--arrival", "constant", "--slo-ttft-ms", "100",
            "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    assert f"wrote {plot}" in capsys.readouterr().out
    assert "knee" in plot.read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--slo-ttft-ms"),
        (["--slo-ttft-ms", "500", "--gpu", "this"], "--cost"),
        (["--slo-ttft-ms", "500", "--gpu", "H100"], "--model"),
        (["--slo-ttft-ms", "500", "--gpu", "H100", "--model", "Llama-3-8B", "--cost", "{cost}"], "leave out --cost"),
        (["--slo-ttft-ms", "500", "--gpu", "Z80", "--model", "Llama-3-8B"], "unknown GPU"),
        (["--slo-ttft-ms", "500", "--cost", "{cost}", "--model", "Llama-3-8B"], "calibration of minserve-tiny"),
        (["--slo-ttft-ms", "500", "--cost", "{cost}", "--slo-attainment", "99"], "--slo-attainment"),
        (["--slo-ttft-ms", "500", "--cost", "{cost}", "--usd-per-hour", "2"], "--target-rate"),
        (["--slo-ttft-ms", "500", "--cost", "{cost}", "--target-rate", "-1"], "--target-rate"),
        (["--slo-ttft-ms", "500", "--cost", "{cost}", "--prompt-len", "long"], "length spec"),
        (["--slo-ttft-ms", "500", "--cost", "{missing}"], "plan calibrate"),
    ],
)
def test_plan_capacity_refuses_bad_input_with_a_message(tmp_path, capsys, extra, message):
    cost = saved_cost(tmp_path)
    argv = ["plan", "capacity", *(a.format(cost=cost, missing=tmp_path / "none.json") for a in extra)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- confirmed on the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm():
    from minserve import LLM

    return LLM(device="cpu", num_threads=1, num_kv_blocks=64, enable_tracing=False)


def engine_envelope(llm, **engine) -> envelope.Envelope:
    config = SchedulerConfig.from_engine(llm).to_dict() | engine
    machine = planner.calibrated_machine(StepCostModel(CPU_LIKE.coefficients, {"engine": config}))
    workload = Workload(parse_length("uniform:24:8"), parse_length("uniform:6:2"), num_requests=6)
    return envelope.plan_capacity(machine, workload, slo.SLO(ttft_s=2.0), 0.5)


def test_serve_on_engine_sends_each_request_when_it_arrives(tiny_llm):
    from minserve.capacity.confirmation import serve_on_engine

    requests = make_requests([0.0, 0.05, 0.3], [20, 12, 16], [3, 5, 2], vocab_size=tiny_llm.model_config.vocab_size)
    outputs = serve_on_engine(tiny_llm, requests, id_prefix="t-")
    assert [len(o.token_ids) for o in outputs] == [3, 5, 2]
    assert [o.request_id for o in outputs] == ["t-0", "t-1", "t-2"]
    arrivals = [o.metrics.arrival_time_s - outputs[0].metrics.arrival_time_s for o in outputs]
    assert arrivals == pytest.approx([0.0, 0.05, 0.3])


def test_confirm_on_engine_lays_the_measurement_beside_the_prediction(tiny_llm):
    from minserve.capacity.confirmation import confirm_on_engine

    envelope = engine_envelope(tiny_llm)
    checks = confirm_on_engine(tiny_llm, envelope)  # half, once and 1.5 times the rate found
    assert [c.share_of_max for c in checks] == pytest.approx([0.5, 1.0, 1.5])
    # The same run as the planner's probe, with other prompt ids: the same prediction.
    assert checks[1].predicted == envelope.at_max_rate
    for check in checks:
        assert check.measured.rate_rps == check.predicted.rate_rps
        assert 0 <= check.measured.attainment["all"] <= 1 and check.measured.mean_e2e_s > 0
        assert check.measured.output_tokens_per_s > 0 and check.wall_s > 0
        row = check.as_row()
        assert {"predicted_attainment", "measured_attainment", "measured_ttft_ms"} <= set(row)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        confirm_on_engine(tiny_llm, engine_envelope(tiny_llm, num_kv_blocks=128), rates_rps=[1.0])


# --- the lab ---------------------------------------------------------------------------------------------


def test_attainment_curve_falls_past_the_capacity():
    from minserve.lab.capacity_planner import attainment_curve

    workload = Workload(fixed(8), fixed(10), num_requests=200, arrival="constant")
    curve = attainment_curve(constant_machine(8), workload, slo.SLO(ttft_s=0.1, tpot_s=0.05), [40.0, 70.0, 120.0])
    assert list(curve["rate_rps"]) == [40.0, 70.0, 120.0]
    assert {"attainment_ttft", "attainment_tpot", "attainment_all", "goodput_rps", "meets_slo"} <= set(curve.columns)
    assert list(curve["meets_slo"]) == [True, True, False]  # 80 requests/s is the capacity
    assert (curve["attainment_all"] <= curve["attainment_ttft"]).all()


def test_attainment_figure_marks_the_knee_and_the_measurement(cpu_envelope):
    from minserve.capacity.confirmation import EngineCheck
    from minserve.lab.capacity_planner import attainment_figure

    probe = cpu_envelope.at_max_rate
    curve = pd.DataFrame(
        {"rate_rps": [1.0, 2.0], "attainment_ttft": [1.0, 0.5], "attainment_all": [1.0, 0.4], "goodput_rps": [1, 0.8]}
    )
    measured = [EngineCheck(1.5, 1.0, probe, probe, 1.0)]
    fig = attainment_figure(curve, 1.5, 0.99, ceiling_rps=1.8, measured=measured)
    shapes = fig.layout.shapes
    assert any(s.type == "line" and s.x0 == 1.5 for s in shapes)  # the knee
    assert any(s.type == "line" and s.x0 == 1.8 for s in shapes)  # the ceiling
    assert any(s.type == "line" and s.y0 == 0.99 for s in shapes)  # the required attainment
    assert [t.name for t in fig.data][:3] == ["TTFT", "all targets", "engine, measured"]


def test_plan_table_and_the_widget(cpu_envelope):
    from minserve.lab.capacity_planner import capacity_planner, plan_table, with_means

    env = cpu_envelope
    table = plan_table(env.machine, env.workload, 20.0, 256, 64, ttft_ms=500, tpot_ms=100, usd_per_replica_hour=2.5)
    assert table.loc["replicas for the target", "value"].startswith(f"{env.deployment.replicas} for 20")
    doubled = plan_table(env.machine, env.workload, 40.0, 256, 64, ttft_ms=500, tpot_ms=100)
    assert int(doubled.loc["replicas for the target", "value"].split()[0]) >= env.deployment.replicas
    scaled = with_means(env.workload, 512, 16)
    assert (scaled.prompt_len.mean, scaled.prompt_len.spread) == (512, 256)
    assert (scaled.output_len.mean, scaled.output_len.spread) == (16, 8)
    widget = capacity_planner(env.machine, env.workload, target_rate_rps=20.0)
    readout = widget.children[-1]
    assert "replicas for the target" in readout.value
    widget.children[4].value = 0.0  # a TPOT bound of 0 ms is refused: the readout says what to change
    assert "tpot_s must be a positive number" in readout.value

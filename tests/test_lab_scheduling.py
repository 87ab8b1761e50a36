"""minserve.lab.scheduling: the step recorder and engine driver, chapter 05's tables and figures, the playground.

The engine tests run the embedded model on tiny configurations and assert on steps and tokens only (never a
speed); the simulator and playground tests use a hand-made step-cost model, so every number is exact.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from minserve import LLM, lab, slo
from minserve.capacity import experiments
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator, StepCostModel
from minserve.engine.policies import ShortestPromptFirst
from minserve.engine.step_report import ScheduledSeq
from minserve.lab import engine_runs, playground, scheduling, simulation_figures
from tests import stand_in

COST = StepCostModel({"base": 1e-3, "prefill_tokens": 1e-5, "decode_seqs": 1e-4})
SMALL = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=512, max_model_len=2048)


def _engine(**options) -> LLM:
    return LLM(device="cpu", num_threads=1, **options)


@pytest.fixture(scope="module")
def vocab() -> int:
    return _engine(num_kv_blocks=8).model_config.vocab_size


# --- the engine driver and recorder ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["static", "fcfs"])
def test_run_engine_records_every_step_and_matches_the_step_formulas(vocab, policy):
    outputs = [3, 1, 4, 1, 5, 9, 2, 6]
    requests = engine_runs.requests_with_prompts([5, 6, 7, 8, 9, 10, 11, 12], outputs, vocab, seed=0)
    run = engine_runs.run_engine(_engine(scheduling_policy=policy, max_num_seqs=3, num_kv_blocks=64), requests, [0] * 8)
    # Static: each batch of three runs as long as its longest; continuous: list scheduling on three seats.
    expected = {"static": 4 + 9 + 6, "fcfs": 12}[policy]  # fcfs: the 9 takes the seat the 3 frees
    assert len(run.steps) == expected and list(run.steps["step"]) == list(range(1, expected + 1))
    assert [len(run.output(r.request_id).token_ids) for r in requests] == outputs
    assert [len(run.token_steps[r.request_id]) for r in requests] == outputs
    assert (run.steps["seqs"] <= 3).all() and (run.steps["tokens"] <= 1024).all()
    # The occupancy agrees with the step rows: per step, the running states are the batch.
    running = run.occupancy[run.occupancy["state"].isin(engine_runs.RUNNING_STATES)]
    assert running.groupby("step").size().tolist() == run.steps["seqs"].tolist()
    assert running.groupby("step")["tokens"].sum().tolist() == run.steps["tokens"].tolist()
    # Each request: one prefill step, then a decode per further token; TTFT in steps counts from arrival.
    for request, n in zip(requests, outputs):
        states = run.occupancy[run.occupancy["request_id"] == request.request_id]
        assert (states["state"] == "prefill").sum() == 1 and (states["state"] == "decode").sum() == n - 1
    table = run.table()
    assert list(table.index) == [r.request_id for r in requests] and (table["TTFT steps"] >= 1).all()
    assert run.ttft_steps("0") == 1 and run.finish_step("0") == table.loc["0", "finish step"] == 3
    assert table["output tokens"].tolist() == outputs and (table["finish"] == "length").all()
    assert len(run.itl_ms()) == sum(n - 1 for n in outputs)
    assert len(run.records) == 8 and all(r.ok for r in run.records)
    assert run.summary()["steps"] == expected


def test_run_engine_with_wall_clock_arrivals(vocab):
    requests = engine_runs.requests_with_prompts([8, 8, 8], 3, vocab, arrivals_s=[0.0, 0.0, 0.05], prefix="w")
    llm = _engine(num_kv_blocks=32)
    run = engine_runs.run_engine(llm, requests)
    assert [o.request_id for o in run.outputs] == ["w0", "w1", "w2"]
    third = run.output("w2").metrics
    assert third.arrival_time_s - run.output("w0").metrics.arrival_time_s == pytest.approx(0.05)
    assert run.arrival_step["w0"] == 0 and run.arrival_step["w2"] >= run.arrival_step["w0"]
    assert third.ttft_s >= 0 and run.wall_s >= 0.05
    with pytest.raises(ValueError, match="arrival steps"):
        engine_runs.run_engine(llm, requests, at_steps=[0])
    with pytest.raises(ValueError, match="unique"):
        engine_runs.run_engine(llm, requests[:1] * 2)
    llm.engine.add_request([1, 2, 3])
    with pytest.raises(ValueError, match="idle"):
        engine_runs.run_engine(llm, requests)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_are_recorded_with_their_states_and_trace(vocab, mode):
    requests = engine_runs.requests_with_prompts([20, 24, 28, 22], 24, vocab, seed=3)
    llm = _engine(block_size=8, max_num_seqs=4, num_kv_blocks=10, preemption_mode=mode)
    run = engine_runs.run_engine(llm, requests, [0] * 4)
    assert run.preemptions and len(run.outputs) == 4
    states = set(run.occupancy["state"])
    assert ("swapped" in states) == (mode == "swap") and ("recompute" in states) == (mode == "recompute")
    assert (run.steps["swapped_blocks"].sum() > 0) == (mode == "swap")
    events = engine_runs.trace_table(run)
    assert set(events["event"]) == {"preempted", "resumed"}
    assert set(events.loc[events["event"] == "preempted", "mode"]) == {mode}
    assert events["ms"].is_monotonic_increasing
    assert run.table()["preemptions"].sum() == len(run.preemptions) == (events["event"] == "preempted").sum()
    fig = scheduling.occupancy_figure(run)
    assert "preempted" in {trace.name for trace in fig.data}


def test_state_of_a_scheduled_sequence():
    prompt = stand_in.make_sequence(0, [1, 2, 3, 4], max_tokens=5)
    assert ScheduledSeq.of(prompt, 4).state == "prefill"
    decoding = stand_in.make_sequence(1, [1, 2, 3, 4], max_tokens=5)
    decoding.output_token_ids, decoding.num_computed_tokens = [9], 4
    assert ScheduledSeq.of(decoding, 1).state == "decode"
    decoding.num_computed_tokens = 0  # preempted by recompute: prompt and output again
    assert ScheduledSeq.of(decoding, 5).state == "recompute"


# --- tables and figures of a run ---------------------------------------------------------------------------


def _hand_run(occupancy: list[tuple[int, str, str, int]]) -> engine_runs.EngineRun:
    return engine_runs.EngineRun(
        requests=[SimRequest(0.0, (1,), 1, request_id="a"), SimRequest(0.0, (1,), 1, request_id="b")],
        outputs=[],
        steps=pd.DataFrame({"step": [1, 2, 3, 4], "tokens": [5, 2, 2, 1], "seqs": [2, 2, 2, 1]}),
        occupancy=pd.DataFrame(occupancy, columns=["step", "request_id", "state", "tokens"]),
        arrival_step={"a": 0, "b": 0},
        token_steps={"a": [1, 2, 3], "b": [2, 3, 4]},
        preemptions=[(3, "b")],
        events=[],
        wall_s=1.0,
    )


def test_occupancy_segments_join_consecutive_steps_in_one_state():
    run = _hand_run(
        [(1, "a", "prefill", 4), (2, "a", "decode", 1), (3, "a", "decode", 1), (1, "b", "waiting", 0),
         (2, "b", "decode", 1), (3, "b", "waiting", 0), (4, "b", "recompute", 3)]
    )  # fmt: skip
    segments = scheduling.occupancy_segments(run)
    assert segments.values.tolist() == [
        ["a", "prefill", 1, 1, 4],
        ["a", "decode", 2, 3, 2],
        ["b", "waiting", 1, 1, 0],
        ["b", "decode", 2, 2, 1],
        ["b", "waiting", 3, 3, 0],
        ["b", "recompute", 4, 4, 3],
    ]
    fig = scheduling.occupancy_figure({"one": run, "two": run}, show_waiting=False)
    names = [trace.name for trace in fig.data]
    assert "waiting" not in names and names.count("preempted") == 2
    assert sum(trace.showlegend is not False for trace in fig.data if trace.name == "decode") == 1
    assert scheduling.occupancy_segments(_hand_run([])).empty


def test_batching_table_and_the_other_figures(vocab):
    requests = engine_runs.requests_with_prompts([8, 9, 10, 11], [5, 1, 1, 5], vocab, seed=1)
    runs = {}
    for policy in ("static", "fcfs"):
        llm = _engine(scheduling_policy=policy, max_num_seqs=2, num_kv_blocks=32)
        runs[policy] = engine_runs.run_engine(llm, requests, [0] * 4)
    table = engine_runs.batching_table(runs)
    # Static: 5 + 5 steps. Continuous: the second 1 and then the last 5 take the seat the first 1 frees.
    assert table.loc["static", "steps"] == 10 and table.loc["fcfs", "steps"] == 7
    assert table.loc["fcfs", "tokens/step"] == pytest.approx(12 / 7)
    chunked = scheduling.chunked_prefill_figure(runs, ["0", "1"], budget=64, arrival_step=2)
    assert [trace.name for trace in chunked.data][-1] == "budget: 64 tokens"
    waits = scheduling.waiting_running_figure(runs)
    assert [trace.name for trace in waits.data] == ["waiting", "running"] * 2
    assert len(scheduling.waiting_running_figure(runs["fcfs"]).data) == 2


# --- the simulator -----------------------------------------------------------------------------------------


def test_mixed_workload_is_seeded_and_mixed():
    requests = experiments.mixed_workload(400, 5.0, seed=2, long_fraction=0.25)
    assert requests == experiments.mixed_workload(400, 5.0, seed=2, long_fraction=0.25)
    long = [r for r in requests if r.prompt_tokens >= 768]
    assert 0.18 < len(long) / 400 < 0.32 and all(r.prompt_tokens <= 1536 for r in long)
    assert all(16 <= r.prompt_tokens <= 64 for r in requests if r.prompt_tokens < 768)
    assert all(16 <= r.output_tokens <= 64 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert not [r for r in experiments.mixed_workload(50, 5.0, long_fraction=0.0) if r.prompt_tokens > 64]


def test_stream_with_long_request():
    stream = experiments.stream_with_long_request(20.0, 5.0, 900, 1.5, seed=4)
    (long,) = [r for r in stream if r.request_id == "long"]
    assert long.arrival_s == 1.5 and long.prompt_tokens == 900
    assert all(r.arrival_s <= 5.0 for r in stream) and 60 < len(stream) < 140
    assert [r.arrival_s for r in stream] == sorted(r.arrival_s for r in stream)
    assert len({r.request_id for r in stream}) == len(stream)


def test_capacity_validation_and_sweep():
    requests = experiments.mixed_workload(60, 5.0, seed=1)
    capacity = experiments.capacity_rps(COST, SMALL, requests)
    assert capacity > 0
    summary = Simulator(COST, SMALL).run(requests).summary()
    table = simulation_figures.validation_table({"low": summary}, {"low": summary})
    assert list(table.index.get_level_values("metric")) == [name for _, name in simulation_figures.COMPARED]
    assert (table["sim / measured"] == 1.0).all()
    assert len(simulation_figures.validation_figure(table).data) == 2 * len(simulation_figures.COMPARED)
    target = slo.SLO(ttft_s=0.5, tpot_s=0.05)
    policies = {"FCFS": "fcfs", "SPF": ShortestPromptFirst(0.0)}
    sweep = simulation_figures.policy_sweep(
        COST, SMALL, lambda rate: experiments.mixed_workload(60, rate, seed=1), policies, [2.0, 8.0], target, 768
    )
    assert list(sweep["policy"]) == ["FCFS", "SPF", "FCFS", "SPF"] and list(sweep["rate_rps"]) == [2, 2, 8, 8]
    assert (sweep["goodput_rps"] <= sweep["request_throughput_rps"] + 1e-12).all() and (sweep["requests"] == 60).all()
    assert {"ttft_short_p99_ms", "ttft_long_max_ms", "sim_wall_s", "virtual_s"} <= set(sweep.columns)
    assert len(simulation_figures.sweep_figure(sweep).data) == 2 * 3


def test_class_summary_and_starvation_figure():
    # Four short requests and a long one, all at once on one seat, shortest first: the long one goes last.
    requests = [SimRequest(0.0, tuple(range(1, 9)), 2, request_id=str(i)) for i in range(4)]
    requests.append(SimRequest(0.0, tuple(range(1, 101)), 2, request_id="long"))
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512, num_kv_blocks=64, scheduling_policy="spf")
    result = Simulator(StepCostModel({"base": 1.0}), config).run(requests)
    classes = experiments.class_summary(result, long_threshold=50)
    assert classes["ttft_long_max_ms"] == pytest.approx(9_000)  # four shorts of 2 steps each, then its prefill
    assert classes["ttft_short_p50_ms"] == pytest.approx(4_000)  # 1, 3, 5, 7 s
    assert experiments.find_request(result, "long").metrics.token_times_s[0] == 9.0
    with pytest.raises(KeyError):
        experiments.find_request(result, "nobody")
    fig = simulation_figures.starvation_figure({"SPF": result}, stream_ends_s=0.0)
    assert [trace.name for trace in fig.data] == ["SPF: waiting", "SPF: long first token", "SPF: long finished"]
    assert fig.data[1].x == (9.0,) and fig.data[2].x == (10.0,)


# --- the playground ----------------------------------------------------------------------------------------


PLAYGROUND = playground.Playground(COST, SMALL, num_requests=80, slo_target=slo.SLO(ttft_s=0.5, tpot_s=0.05))


def test_playground_result_invariants():
    result = playground.playground_result(PLAYGROUND, "fcfs", 4.0)
    assert result["error"] == "" and result["requests"] == 80
    assert result["goodput_rps"] <= result["request_throughput_rps"]
    assert result["max_step_tokens"] <= SMALL.max_num_batched_tokens
    again = playground.playground_result(PLAYGROUND, "fcfs", 4.0)
    assert {k: v for k, v in again.items() if k != "wall_s"} == {k: v for k, v in result.items() if k != "wall_s"}
    whole = playground.playground_result(PLAYGROUND, "fcfs", 4.0, chunked_prefill=False)
    assert whole["max_step_tokens"] >= 768  # a long prompt went through in one step
    tight = playground.playground_result(PLAYGROUND, "fcfs", 20.0, num_kv_blocks=120)
    assert tight["error"] == "" and tight["preemptions"] > 0
    too_small = playground.playground_result(PLAYGROUND, "fcfs", 4.0, num_kv_blocks=8)
    assert "KV cache" in too_small["error"]
    assert "KV cache" in playground.playground_html(too_small)
    assert "goodput" in playground.playground_html(result, PLAYGROUND.slo_target)


def test_playground_policies_and_widget():
    choices = playground.playground_policies(aging_tokens_per_step=2.0)
    assert list(choices)[:2] == ["FCFS", "static batching"]
    assert [p.aging_tokens_per_step for p in choices.values() if isinstance(p, ShortestPromptFirst)] == [0.0, 2.0]
    widget = lab.scheduling_playground(PLAYGROUND, rate_rps=4.0, max_rate_rps=10.0)
    policy, rate, chunked, blocks, readout = widget.children
    first = readout.value
    assert "goodput" in first and blocks.value == SMALL.num_kv_blocks
    rate.value = 9.0
    assert readout.value != first
    shown = readout.value
    policy.value = list(choices)[2]
    chunked.value = False
    assert readout.value != shown
    blocks.value = blocks.min
    assert "KV cache" in readout.value or "goodput" in readout.value
    assert lab.playground_result is playground.playground_result and lab.run_engine is engine_runs.run_engine
    assert math.isfinite(playground.playground_result(PLAYGROUND, choices["FCFS"], 1.0)["ttft_ms"]["p50"])

"""Chapter 06's lab helpers on their own, without an engine: the arithmetic behind its tables (overlap of a
pipeline's stages, cached tokens predicted from a placement, keys moved when a replica is lost, the latency
prediction, the balanced all-to-all, the planner's per-size tables) and the figures drawn from them."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from minserve.capacity import parallel as capacity_parallel
from minserve.capacity.interconnect import Interconnect, interconnect, ring_all_gather_s, ring_all_reduce_s
from minserve.capacity.roofline import hardware
from minserve.lab import parallel, parallel_experts, parallel_figures, parallel_routing, parallel_runs
from minserve.model.loader import load_config, resolve_model_path
from minserve.parallel import Traffic
from minserve.parallel.pipeline import PipelineStats, StepTimeline, predicted_bubble_fraction

TINY = load_config(resolve_model_path("minserve-tiny"))


def _gpipe(p: int, m: int, t: float = 1.0) -> StepTimeline:
    return StepTimeline([[((s + i) * t, (s + i + 1) * t) for i in range(m)] for s in range(p)])


@pytest.mark.parametrize(("p", "m", "overlap"), [(2, 1, 0.0), (2, 3, 2.0), (3, 2, 2.0), (3, 1, 0.0)])
def test_concurrent_seconds_of_gpipes_schedule(p, m, overlap):
    assert parallel_runs.concurrent_s(_gpipe(p, m)) == pytest.approx(overlap)


def test_bubble_table_of_ideal_steps_is_the_formula():
    table = parallel_runs.bubble_table({m: PipelineStats([_gpipe(2, m, 0.01)] * 3) for m in (1, 2, 4)})
    for m in (1, 2, 4):
        assert table.loc[m, "bubble (measured)"] == pytest.approx(predicted_bubble_fraction(2, m))
        assert table.loc[m, "step ms"] == pytest.approx(10 * (m + 1))
        assert [table.loc[m, "stage 0 ms"], table.loc[m, "stage 1 ms"]] == pytest.approx([10 * m, 10 * m])
    assert table.loc[1, "overlap share"] == 0 < table.loc[4, "overlap share"]


def test_cached_tokens_are_predicted_from_the_same_replicas_history():
    a, b = list(range(1, 11)), [*range(1, 9), 99, 98]
    prompts, placement = [a, b, a, a], ["x", "x", "y", "x"]
    # b shares 8 tokens (two blocks of 4) with a; a on y finds nothing; a again on x at most its own length − 1
    assert parallel_routing.predicted_cached_tokens(prompts, placement, block_size=4) == [0, 8, 0, 8]


def test_policies_place_prompts_as_the_router_does():
    prompts = ["shared system prompt " * 20 + f"question {i}" for i in range(6)]
    assert parallel_routing.place("round-robin", ["a", "b"], prompts) == ["a", "b"] * 3
    assert len(set(parallel_routing.place("prefix-aware", ["a", "b", "c"], prompts))) == 1


def test_rendezvous_moves_only_the_lost_replicas_keys():
    keys = [f"# system prompt {i}\n" for i in range(300)]
    moved = parallel_routing.moved_on_loss(keys, ["r0", "r1", "r2"], lost="r2")
    assert moved.loc["rendezvous", "moved"] == moved.loc["rendezvous", "on r2"] > 0
    assert moved.loc["hash mod n", "moved"] > 1.5 * moved.loc["hash mod n", "on r2"]


def test_router_benchmark_table_reads_the_recorded_run():
    table, settings = parallel_routing.router_benchmark_table()
    recorded = json.loads(parallel_routing.ROUTER_RESULTS.read_text())
    assert settings == recorded["settings"]
    assert list(table.index) == [row["policy"] for row in recorded["rows"]]
    assert list(table["hit rate"]) == [row["hit_rate"] for row in recorded["rows"]]


def _run(steps: list[dict], params: int = 1) -> parallel_runs.TrafficRun:
    return parallel_runs.TrafficRun([[1]], pd.DataFrame(steps), params, 4096)


def test_latency_prediction_is_half_the_step_plus_the_collectives_on_the_link():
    one = _run([{"decode": False, "executor_s": 0.05}] + [{"decode": True, "executor_s": 0.004}] * 3)
    step = {"decode": True, "executor_s": 0.009, "seconds": 0.003, "all_reduce_calls": 9, "all_reduce_bytes": 9 * 4096,
            "all_gather_calls": 1, "all_gather_bytes": 8192}  # fmt: skip
    split = _run([step] * 3)
    link = Interconnect("test", bandwidth_bytes_per_s=1e9, latency_s=1e-4)
    table = parallel_runs.latency_table(one, split, size=2, link=link)
    collectives_s = 9 * ring_all_reduce_s(4096, 2, link) + ring_all_gather_s(8192, 2, link)
    assert table.loc["TP=2", "collectives ms (predicted)"] == pytest.approx(1e3 * collectives_s)
    assert table.loc["TP=2", "step ms (predicted)"] == pytest.approx(2.0 + 1e3 * collectives_s)
    assert table.loc["one process", "step ms (measured)"] == pytest.approx(4.0)  # decode steps only
    assert table.loc["TP=2", "in collectives ms (measured)"] == pytest.approx(3.0)


def _expert_run(pairs: torch.Tensor, tokens: int) -> parallel_experts.ExpertParallelRun:
    config = dataclasses.replace(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=688,
                                 moe_layers=(0, 1, 2, 3))  # fmt: skip
    crossed = int(pairs.sum() - pairs.diagonal().sum())
    load = torch.full((4, 2), tokens)
    return parallel_experts.ExpertParallelRun(config, 2, [[1]], [[1]], load, load, load, pairs,
                                              Traffic(all_to_all_bytes=crossed * 1024), tokens, 4)  # fmt: skip


def test_balanced_dispatch_is_half_of_every_pair_for_two_ranks():
    run = _expert_run(torch.tensor([[300, 100], [100, 300]]), tokens=100)  # 4 layers × 100 tokens × 2
    table = parallel_experts.expert_traffic_table(run)
    assert table.loc["balanced routing (predicted)", "dispatch bytes"] == 4 * 100 * 2 * 256 * 4 / 2
    assert table.loc["this run (measured)", "crossed share"] == pytest.approx(0.25)
    assert table.loc["this run (measured)", "bytes per crossing pair"] == 1024


def test_memory_fit_and_scaling_tables_are_the_planners_numbers():
    fit = parallel.memory_fit_table(["Llama-3-70B"], sizes=(1, 2, 4))
    h100, link = hardware("H100"), interconnect("nvlink4")
    for _, row in fit.iterrows():
        plan = capacity_parallel.plan_layout("Llama-3-70B", capacity_parallel.Layout(row["TP"]), h100, link, 1, 4096)
        assert row["weights GB/GPU"] == plan.weights_bytes_per_gpu / 1e9
        assert row["weights fit"] == (row["TP"] > 1)
        assert row["sequences"] == (plan.kv_tokens_per_gpu // 4096 if row["weights fit"] else 0)
    scaling = parallel.tensor_parallel_scaling("Llama-3-70B", links=("nvlink4",), sizes=(2, 4))
    plan4 = capacity_parallel.plan_layout("Llama-3-70B", capacity_parallel.Layout(4), h100, link, 1, 4096)
    assert scaling.loc[1, "ms/token"] == pytest.approx(plan4.step_s * 1e3)
    assert scaling.loc[0, "speed-up over TP2"] == 1 < scaling.loc[1, "speed-up over TP2"]


def test_figures_draw_the_tables_they_are_given():
    steps = pd.DataFrame({"tokens": [38, 4, 4], "all_reduce_bytes": [38 * 9216, 4 * 9216, 4 * 9216],
                          "all_reduce_calls": [9, 9, 9]})  # fmt: skip
    traffic = parallel_figures.traffic_figure(steps, 9216)
    assert list(traffic.data[0].y) == [0, 38 * 9216 / 1e3] and list(traffic.data[1].x) == [38, 4, 4]
    stats = {m: PipelineStats([_gpipe(2, m, 0.01)]) for m in (1, 4)}
    timeline = parallel_figures.timeline_figure(stats)
    assert len(timeline.data) == 2 * 1 + 2 * 4  # a bar per stage and micro-batch
    bubble = parallel_figures.bubble_figure(parallel_runs.bubble_table(stats))
    assert list(bubble.data[1].y) == pytest.approx([predicted_bubble_fraction(2, 1), predicted_bubble_fraction(2, 4)])
    routing = pd.DataFrame({"hit rate (measured)": [0.5, 0.7], "hit rate (predicted)": [0.5, 0.7]},
                           index=["round-robin", "prefix-aware"])  # fmt: skip
    assert list(parallel_figures.routing_figure(routing).data[0].x) == ["round-robin", "prefix-aware"]
    run = _expert_run(torch.tensor([[300, 100], [100, 300]]), tokens=100)
    load = parallel_figures.expert_load_figure(run)
    assert [list(trace.y) for trace in load.data] == [[100] * 4, [100] * 4]
    fit = parallel.memory_fit_figure(parallel.memory_fit_table(["Llama-3-8B", "Llama-3-70B"], sizes=(1, 2)))
    assert [trace.name for trace in fit.data] == ["Llama-3-8B", "Llama-3-70B"]

"""Chapter 06's check cells can fail: each check holds on what the engine (or the planner) measured, and fails
on the same measurement with its property taken away (a collective dropped, a stage that does not wait, a
cache shared between replicas, a rank's experts idle, a planner that does not divide the weights).

The engine runs are small (minserve-tiny, float32, one thread a rank): one tensor-parallel pair, one
two-stage pipeline, one expert-parallel pair and two in-process replicas, each started once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.capacity import parallel as capacity_parallel
from minserve.capacity.interconnect import Interconnect, ring_all_reduce_s
from minserve.lab import parallel, parallel_checks, parallel_experts, parallel_link, parallel_routing, parallel_runs
from minserve.parallel.pipeline import PipelineStats, StepTimeline

OPTIONS = parallel_runs.ENGINE_OPTIONS
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "for line in open(path):"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MODELS = ["Llama-3-8B", "Llama-3-70B", "Mixtral-8x7B"]


@pytest.fixture(scope="module")
def one():
    llm = LLM(**OPTIONS)
    return parallel_runs.run_engine_steps(llm, PROMPTS, GREEDY), llm.model_config


@pytest.fixture(scope="module")
def tensor_parallel():
    llm = LLM(tensor_parallel_size=2, **OPTIONS)
    try:
        return parallel_runs.run_engine_steps(llm, PROMPTS, GREEDY)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def pipeline():
    llm = LLM(pipeline_parallel_size=2, num_micro_batches=2, **OPTIONS)
    try:
        run = parallel_runs.run_engine_steps(llm, PROMPTS, GREEDY)
        # Prompts of 256 tokens, as the chapter's: with 64 a micro-batch's forward was as short as the hand-off
        # between the stages, and on a busy 2-core machine stage 0 could finish both before stage 1 began.
        return run, parallel_runs.bubble_sweep(llm, micro_batches=(1, 2), prompt_tokens=256, rounds=2)
    finally:
        llm.engine.shutdown()


# --- memory fit ---------------------------------------------------------------------------------------------------


def test_memory_fit_holds_on_the_planner():
    verdicts = parallel_checks.check_memory_fit(parallel.memory_fit_table(MODELS))
    assert verdicts["Llama-3-70B TP1"] == 0 < verdicts["Llama-3-70B TP2"] < verdicts["Llama-3-8B TP1"]


def test_memory_fit_fails_for_a_planner_that_does_not_divide_the_weights(monkeypatch):
    whole = capacity_parallel.stage_params_per_gpu
    monkeypatch.setattr(capacity_parallel, "stage_params_per_gpu", lambda model, stage, t=1: whole(model, stage, 1))
    with pytest.raises(AssertionError, match="Llama-3-70B on two GPUs: weights fit False"):
        parallel_checks.check_memory_fit(parallel.memory_fit_table(MODELS))


def test_memory_fit_fails_for_a_planner_that_counts_only_the_active_experts(monkeypatch):
    def active_only(count):
        return lambda config: count(dataclasses.replace(config, num_experts=config.num_experts_per_tok))

    monkeypatch.setattr(parallel, "estimate_params", active_only(parallel.estimate_params))
    monkeypatch.setattr(capacity_parallel, "decoder_params", active_only(capacity_parallel.decoder_params))
    with pytest.raises(AssertionError, match=r"Mixtral-8x7B: 1\d\.\d\dB parameters counted, 46.70B published"):
        parallel_checks.check_memory_fit(parallel.memory_fit_table(MODELS))


# --- tensor parallelism ------------------------------------------------------------------------------------------


def test_same_tokens_holds_for_tensor_parallelism_and_fails_on_a_swapped_token(one, tensor_parallel):
    run, _ = one
    assert parallel_checks.check_same_tokens(run.token_ids, tensor_parallel.token_ids, "TP") == 3 * 8
    swapped = [list(t) for t in tensor_parallel.token_ids]
    at = next(j for j in range(len(swapped[1]) - 1) if swapped[1][j] != swapped[1][j + 1])
    swapped[1][at], swapped[1][at + 1] = swapped[1][at + 1], swapped[1][at]  # two tokens in the wrong order
    with pytest.raises(AssertionError, match=f"TP: request 1 differs from one process's at token {at}"):
        parallel_checks.check_same_tokens(run.token_ids, swapped, "TP")
    with pytest.raises(AssertionError, match="2 requests, one process had 3"):
        parallel_checks.check_same_tokens(run.token_ids, tensor_parallel.token_ids[:2], "TP")


def test_traffic_is_the_formulas_in_every_step(one, tensor_parallel):
    _, config = one
    result = parallel_checks.check_tensor_parallel_traffic(tensor_parallel.steps, config, 2, "float32")
    assert result["all-reduce bytes"] == result["formula"] > 0
    assert result["all-reduce bytes per token"] == (2 * config.num_layers + 1) * config.hidden_size * 4


@pytest.mark.parametrize(
    "broken",
    [
        "no embedding all-reduce",  # a vocab-parallel embedding whose partial lookups were never summed
        "half the bytes",  # activations counted at two bytes: not what float32 ranks send
        "whole vocabulary gathered",  # each rank's logits over the whole vocabulary, not its half
    ],
)
def test_traffic_check_fails_when_the_count_is_not_the_formulas(one, tensor_parallel, broken):
    _, config = one
    steps = tensor_parallel.steps.copy()
    if broken == "no embedding all-reduce":
        steps["all_reduce_bytes"] -= steps["tokens"] * config.hidden_size * 4
        steps["all_reduce_calls"] -= 1
    elif broken == "half the bytes":
        steps["all_reduce_bytes"] //= 2
    else:
        steps["all_gather_bytes"] *= 2
    with pytest.raises(AssertionError, match=f"{len(steps)} of {len(steps)} steps sent other than the formula"):
        parallel_checks.check_tensor_parallel_traffic(steps, config, 2, "float32")


def test_rank_memory_holds_for_tensor_parallelism_and_fails_for_a_shard_that_keeps_too_much(one, tensor_parallel):
    run, config = one
    result = parallel_checks.check_rank_memory(run, tensor_parallel, config, tensor_parallel_size=2)
    assert 0.5 <= result["rank 0 share"] < 0.51  # half, and a copy of every norm
    whole_embedding = dataclasses.replace(
        tensor_parallel, params_here=tensor_parallel.params_here + config.vocab_size // 2 * config.hidden_size
    )
    with pytest.raises(AssertionError, match="rank 0 holds .* its share .* is"):
        parallel_checks.check_rank_memory(run, whole_embedding, config, tensor_parallel_size=2)
    every_kv_head = dataclasses.replace(tensor_parallel, kv_bytes_per_token=run.kv_bytes_per_token)
    with pytest.raises(AssertionError, match="KV bytes a token"):
        parallel_checks.check_rank_memory(run, every_kv_head, config, tensor_parallel_size=2)


# --- pipeline parallelism ----------------------------------------------------------------------------------------


def test_pipeline_checks_hold_on_the_engine(one, pipeline):
    (run, config), (pp, bubbles) = one, pipeline
    parallel_checks.check_same_tokens(run.token_ids, pp.token_ids, "PP")
    parallel_checks.check_rank_memory(run, pp, config, pipeline_parallel_size=2)
    result = parallel_checks.check_pipeline_schedule(bubbles)
    assert result[1]["overlap share"] == 0 and result[1]["bubble (measured)"] >= 0.5  # order forces it
    assert result[2]["overlap share"] > 0


def _with_steps(stats: PipelineStats, change) -> PipelineStats:
    return PipelineStats([StepTimeline(change([list(spans) for spans in step.spans])) for step in stats.steps])


def test_schedule_check_fails_for_a_stage_that_does_not_wait(pipeline):
    _, bubbles = pipeline

    def early(spans):  # stage 1 begins micro-batch 1 before stage 0 has finished it
        (start0, end0), (_, end1) = spans[0][0], spans[1][0]
        spans[1][0] = ((start0 + end0) / 2, end1)
        return spans

    with pytest.raises(AssertionError, match=r"m=1, step 0: stage 1 began micro-batch\(es\) \[0\] before stage 0"):
        parallel_checks.check_pipeline_schedule({1: _with_steps(bubbles[1], early), 2: bubbles[2]})


def test_schedule_check_fails_for_stages_that_never_work_at_once(pipeline):
    _, bubbles = pipeline

    def one_after_the_other(spans):  # micro-batch 2 starts on stage 0 only once stage 1 finished micro-batch 1
        t, serial = 0.0, [[], []]
        for i in range(len(spans[0])):
            for s in (0, 1):
                length = spans[s][i][1] - spans[s][i][0]
                serial[s].append((t, t + length))
                t += length
        return serial

    serial = _with_steps(bubbles[2], one_after_the_other)
    assert serial.bubble_fraction == pytest.approx(0.5)  # no better than one micro-batch
    with pytest.raises(AssertionError, match="m=2: the stages never worked at the same time"):
        parallel_checks.check_pipeline_schedule({1: bubbles[1], 2: serial})


def test_schedule_check_fails_for_a_step_that_was_not_split(pipeline):
    _, bubbles = pipeline
    with pytest.raises(AssertionError, match=r"m=2, step 0: \[1, 1\] micro-batches per stage, not 2"):
        parallel_checks.check_pipeline_schedule({2: bubbles[1]})


# --- data parallelism --------------------------------------------------------------------------------------------

POLICIES = ["round-robin", "prefix-aware"]
FEW_TOKENS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _routing(replicas: dict[str, LLM]):
    requests = parallel_routing.chat_workload(next(iter(replicas.values())), num_prefixes=3, per_prefix=3,
                                              prefix_tokens=96, question_tokens=8)  # fmt: skip
    return parallel_routing.routing_run(replicas, requests, POLICIES, FEW_TOKENS)


@pytest.fixture(scope="module")
def routed():
    return _routing({"replica-0": LLM(**OPTIONS), "replica-1": LLM(**OPTIONS)})


def test_routing_check_holds_on_two_replicas(routed):
    rates = parallel_checks.check_routing(routed)
    assert rates["prefix-aware"] > rates["round-robin"] > 0


def test_routing_check_fails_for_replicas_that_share_one_cache():
    shared = LLM(**OPTIONS)  # both names, one engine: a request finds what "the other replica" computed
    with pytest.raises(AssertionError, match="requests found other than the predicted cached tokens"):
        parallel_checks.check_routing(_routing({"replica-0": shared, "replica-1": shared}))


def test_routing_check_fails_for_replicas_without_a_prefix_cache():
    replicas = {name: LLM(enable_prefix_caching=False, **OPTIONS) for name in ("replica-0", "replica-1")}
    with pytest.raises(AssertionError, match="requests found other than the predicted cached tokens"):
        parallel_checks.check_routing(_routing(replicas))


def test_routing_check_fails_when_prefix_aware_spreads_a_prefix_or_gains_nothing(routed):
    spread = routed.copy()
    first = spread.index[spread["policy"] == "prefix-aware"][0]
    others = {"replica-0": "replica-1", "replica-1": "replica-0"}
    spread.loc[first, "replica"] = others[spread.loc[first, "replica"]]
    with pytest.raises(AssertionError, match="prefix-aware sent prefixes .* to several replicas"):
        parallel_checks.check_routing(spread)
    cold = routed.copy()
    cold.loc[cold["policy"] == "prefix-aware", ["cached (predicted)", "cached (measured)"]] = 0
    with pytest.raises(AssertionError, match="prefix-aware hit rate 0.000 is not above round-robin's"):
        parallel_checks.check_routing(cold)


# --- expert parallelism ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    model_dir = parallel_experts.upcycled_moe_checkpoint(tmp_path_factory.mktemp("moe") / "tiny-moe")
    return parallel_experts.run_expert_parallel(model_dir, PROMPTS, GREEDY)


def test_expert_parallel_check_holds_on_two_ranks(experts):
    result = parallel_checks.check_expert_parallel(experts)
    assert sum(result["load per rank"]) == len(experts.config.moe_layers) * result["pairs per layer"]
    table = parallel_experts.expert_traffic_table(experts)
    assert table.loc["this run (measured)", "dispatch bytes"] == experts.traffic.all_to_all_bytes


def test_expert_parallel_check_fails_on_a_rank_whose_work_went_missing(experts):
    load = experts.load_per_rank.clone()
    load[:, 1] = 0
    with pytest.raises(AssertionError, match="pairs per layer"):
        parallel_checks.check_expert_parallel(dataclasses.replace(experts, load_per_rank=load))
    idle = experts.load_per_rank.clone()
    idle[0] = torch.tensor([idle[0].sum(), 0])  # rank 0 ran every pair of layer 0: rank 1 held no expert of use
    with pytest.raises(AssertionError, match=r"\(layer, rank\) pairs with no work: \[\[0, 1\]\]"):
        parallel_checks.check_expert_parallel(dataclasses.replace(experts, load_per_rank=idle))


def test_expert_parallel_check_fails_on_bytes_that_count_the_rows_a_rank_keeps(experts):
    kept_rows = int(experts.pairs[0, 0]) * experts.config.hidden_size * experts.element_bytes
    counted_all = dataclasses.replace(
        experts.traffic, all_to_all_bytes=experts.traffic.all_to_all_bytes + 2 * kept_rows
    )
    with pytest.raises(AssertionError, match="rank 0 counted .* all-to-all bytes"):
        parallel_checks.check_expert_parallel(dataclasses.replace(experts, traffic=counted_all))


def test_expert_parallel_check_fails_on_other_tokens_or_another_routing(experts):
    shuffled = [list(reversed(t)) for t in experts.token_ids]
    with pytest.raises(AssertionError, match="expert parallelism: request 0 differs"):
        parallel_checks.check_expert_parallel(dataclasses.replace(experts, token_ids=shuffled))
    moved = experts.load.clone()
    moved[0, 0], moved[0, 1] = moved[0, 0] + 1, moved[0, 1] - 1  # a pair run by the wrong expert
    with pytest.raises(AssertionError, match="expert load differs from one process's"):
        parallel_checks.check_expert_parallel(dataclasses.replace(experts, load=moved))


# --- the α–β fit and the bubble's band ------------------------------------------------------------------------


def _alpha_beta(latency_s: float = 50e-6, bandwidth: float = 1e9, slow_middle: float = 1.0):
    """All-reduce times of a link that is α + S / B (``slow_middle`` multiplies the held-out sizes' times)."""
    link = Interconnect("test", bandwidth, latency_s)
    seconds = [ring_all_reduce_s(s, 2, link) for s in parallel_link.DEFAULT_SIZES]
    seconds[1:-1] = [t * slow_middle for t in seconds[1:-1]]
    return parallel_link.LinkMeasurement(parallel_link.DEFAULT_SIZES, tuple(seconds), 2)


def test_link_fit_holds_on_an_alpha_beta_link():
    measured = _alpha_beta()
    link = parallel_link.fit_ring(measured)
    assert link.latency_s == pytest.approx(50e-6) and link.bandwidth_bytes_per_s == pytest.approx(1e9)
    ratios = parallel_checks.check_link_fit(parallel_link.link_table(measured, link), within=2.0)
    assert list(ratios.values()) == pytest.approx([1.0, 1.0])


def test_link_fit_fails_on_a_link_that_is_not_alpha_plus_bytes_over_bandwidth():
    switched = _alpha_beta(slow_middle=4.0)  # a protocol that turns slow between the two fitted sizes
    table = parallel_link.link_table(switched, parallel_link.fit_ring(switched))
    with pytest.raises(AssertionError, match="held-out all-reduces of .* not within ×2"):
        parallel_checks.check_link_fit(table, within=2.0)
    with pytest.raises(AssertionError, match="no held-out size"):
        parallel_checks.check_link_fit(table[table["role"] == "fitted"])


def _steps(p: int, m: int, overlap: bool = True, t: float = 0.01) -> PipelineStats:
    """GPipe's timeline of ``p`` equal stages and ``m`` micro-batches; without ``overlap`` each stage starts
    only when the one before has finished every micro-batch (no pipelining at all)."""
    if overlap:
        spans = [[((s + i) * t, (s + i + 1) * t) for i in range(m)] for s in range(p)]
    else:
        spans = [[((s * m + i) * t, (s * m + i + 1) * t) for i in range(m)] for s in range(p)]
    return PipelineStats([StepTimeline(spans)] * 2)


def test_bubble_band_holds_on_gpipes_schedule():
    table = parallel_runs.bubble_table({m: _steps(2, m) for m in (1, 2, 4)})
    assert parallel_checks.check_bubble_band(table, within=0.2) == {1: (0.5, 0.5), 2: (0.333, 0.333), 4: (0.2, 0.2)}


def test_bubble_band_fails_for_stages_that_never_overlap():
    table = parallel_runs.bubble_table({m: _steps(2, m, overlap=False) for m in (1, 2, 4)})
    assert table["bubble (measured)"].tolist() == pytest.approx([0.5, 0.5, 0.5])
    with pytest.raises(AssertionError, match=r"outside \[predicted − 0.1, predicted \+ 0.2\]: \{4: \(0.2, 0.5\)\}"):
        parallel_checks.check_bubble_band(table, within=0.2, below=0.1)
    with pytest.raises(AssertionError, match="the bubble did not shrink with micro-batches"):
        parallel_checks.check_bubble_band(table, within=0.5)

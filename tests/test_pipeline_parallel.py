"""Pipeline parallelism: the layers split into stages give the whole model's logits; two stages over gloo give
one process's greedy tokens exactly (float32) with prefix hits, chunked prefill and preemption, with one or
two micro-batches a step; each stage caches only its layers; nothing leaks; a dead stage fails loudly; the
bubble's measurement agrees with its formula on an ideal schedule."""

import itertools
import os
import pathlib
import signal
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minserve import LLM, SamplingParams
from minserve.engine.pipeline_parallel import micro_batch_ranges, split_micro_batches
from minserve.engine.workers import RankFailure
from minserve.model.attention import AttentionMetadata
from minserve.model.loader import load_config, load_model, resolve_model_path
from minserve.parallel.pipeline import (
    PipelineStats,
    StepTimeline,
    check_pipeline_parallel,
    keep_stage,
    predicted_bubble_fraction,
    stage_layers,
)

PREFIX = "def fibonacci(n):\n    " * 6  # shared by several prompts: prefix-cache hits
PROMPTS = [PREFIX + "return", PREFIX + "if n", "import os\n\n\ndef walk(path):", "class Stack:\n" * 12, "The quick"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
# Small steps and a small cache: long prompts are prefilled in chunks, and sequences are preempted.
TIGHT = {"dtype": "float32", "max_num_batched_tokens": 32, "num_kv_blocks": 14, "enable_tracing": False}
TINY = load_config(resolve_model_path("minserve-tiny"))  # 4 layers


# --- the model cut into stages -----------------------------------------------------------------------------


@given(st.integers(1, 40), st.integers(1, 40))
def test_stages_hold_every_layer_once_in_order_as_evenly_as_possible(num_layers, num_stages):
    if num_stages > num_layers:
        with pytest.raises(ValueError, match=rf"pipeline_parallel_size={num_stages} .* use 1 … {num_layers}"):
            check_pipeline_parallel(replace(TINY, num_layers=num_layers), num_stages)
        return
    stages = [stage_layers(num_layers, num_stages, s) for s in range(num_stages)]
    assert [i for layers in stages for i in layers] == list(range(num_layers))
    sizes = [len(layers) for layers in stages]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first stages take the extra layers


def test_stages_chained_give_the_whole_models_logits():
    path, ids = resolve_model_path("minserve-tiny"), torch.tensor([1, 5, 9, 42, 7, 300, 2000, 17, 3, 3])
    whole = load_model(path, torch.float32).logits_without_cache(ids)
    meta, positions = AttentionMetadata.without_cache([len(ids)]), torch.arange(len(ids))
    x, num_stages = ids, 3  # 4 layers: 2, 1, 1
    with torch.inference_mode():
        for stage in range(num_stages):
            model = load_model(path, torch.float32)
            kept = keep_stage(model, stage, num_stages)
            assert len(model.layers) == len(kept) and (model.lm_head is None) == (stage < num_stages - 1)
            x = model(x, positions, meta)
        logits = model.compute_logits(x)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


# --- micro-batches ---------------------------------------------------------------------------------------------


@given(st.lists(st.integers(1, 64), min_size=1, max_size=20), st.integers(1, 8))
def test_micro_batches_are_contiguous_runs_of_whole_sequences_with_near_equal_tokens(query_lens, m):
    ranges = micro_batch_ranges(query_lens, m)
    assert len(ranges) == min(m, len(query_lens)) and all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(query_lens)))
    share = sum(query_lens) / len(ranges)
    assert all(sum(query_lens[i] for i in r) <= share + max(query_lens) for r in ranges)


def test_micro_batches_put_the_steps_tokens_and_rows_back_together():
    query_lens = [5, 1, 1, 7, 2]
    total = sum(query_lens)
    meta = AttentionMetadata(query_lens=query_lens, context_lens=[n + 3 for n in query_lens],
                             slot_mapping=torch.arange(100, 100 + total),
                             block_tables=torch.arange(len(query_lens) * 3).view(-1, 3))  # fmt: skip
    rows = [4, 5, 6, 13, 15]  # the last token of each sequence
    batches = split_micro_batches(torch.arange(total) * 10, torch.arange(total), meta, rows, 3)
    assert len(batches) == 3
    assert torch.equal(torch.cat([mb.input_ids for mb in batches]), torch.arange(total) * 10)
    assert torch.equal(torch.cat([mb.meta.slot_mapping for mb in batches]), meta.slot_mapping)
    assert torch.equal(torch.cat([mb.meta.block_tables for mb in batches]), meta.block_tables)
    assert [n for mb in batches for n in mb.meta.query_lens] == query_lens
    assert [n for mb in batches for n in mb.meta.context_lens] == meta.context_lens
    offsets = [0]
    for mb in batches:
        assert mb.num_tokens == mb.meta.num_tokens
        offsets.append(offsets[-1] + mb.num_tokens)
    assert [row + offset for mb, offset in zip(batches, offsets) for row in mb.rows] == rows


# --- the bubble ---------------------------------------------------------------------------------------------


def _ideal_schedule(p: int, m: int, t: float = 0.5) -> StepTimeline:
    """GPipe's schedule with every micro-batch taking ``t`` seconds on every stage."""
    return StepTimeline([[((s + i) * t, (s + i + 1) * t) for i in range(m)] for s in range(p)])


@given(st.integers(1, 8), st.integers(1, 16))
def test_the_bubble_measured_on_an_ideal_schedule_is_the_formulas(p, m):
    step = _ideal_schedule(p, m)
    assert step.bubble_fraction == pytest.approx(predicted_bubble_fraction(p, m))
    assert step.predicted_bubble_fraction == predicted_bubble_fraction(p, m)
    stats = PipelineStats([step, _ideal_schedule(p, m, t=2.0)])
    assert stats.bubble_fraction == pytest.approx(predicted_bubble_fraction(p, m))


def test_the_formula_on_known_values():
    assert predicted_bubble_fraction(1, 4) == 0  # one stage never waits
    assert predicted_bubble_fraction(2, 1) == 1 / 2  # two stages, one micro-batch: each idles half the step
    assert predicted_bubble_fraction(4, 4) == 3 / 7
    assert predicted_bubble_fraction(2, 4) < predicted_bubble_fraction(2, 2) < predicted_bubble_fraction(2, 1)
    with pytest.raises(ValueError, match="m ≥ 1"):
        predicted_bubble_fraction(2, 0)


def test_a_stage_left_waiting_counts_as_bubble():
    # stage 1 starts micro-batch 1 a second late: 1 s idle of 2 stages × 3 s
    late = StepTimeline([[(0.0, 1.0), (1.0, 2.0)], [(2.0, 3.0), (3.0, 4.0)]])
    on_time = StepTimeline([[(0.0, 1.0), (1.0, 2.0)], [(1.0, 2.0), (2.0, 3.0)]])
    assert late.bubble_fraction > on_time.bubble_fraction == pytest.approx(predicted_bubble_fraction(2, 2))


# --- the engine ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process():
    """One process's engine and greedy tokens, by preemption mode (made when first asked for)."""
    made = {}

    def run(preemption_mode: str):
        if preemption_mode not in made:
            llm = LLM(preemption_mode=preemption_mode, **TIGHT)
            made[preemption_mode] = llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return made[preemption_mode]

    return run


# Swapping sends each sequence's blocks out of, and back into, every stage's cache.
@pytest.mark.parametrize(("num_micro_batches", "preemption_mode"), [(2, "recompute"), (1, "swap")])
def test_two_stages_give_one_process_greedy_tokens_with_prefix_hits_chunks_and_preemption(
    one_process, num_micro_batches, preemption_mode
):
    one, expected = one_process(preemption_mode)
    llm = LLM(pipeline_parallel_size=2, num_micro_batches=num_micro_batches, preemption_mode=preemption_mode,
              **TIGHT)  # fmt: skip
    swapped_blocks = []
    llm.engine.core.observers.append(lambda report: swapped_blocks.append(report.num_swapped_blocks))
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0
        assert stats["prefix_cache_hit_rate"] > 0 and stats["num_preemptions"] > 0
        assert (sum(swapped_blocks) > 0) == (preemption_mode == "swap")
        # each stage caches two of the four layers: the same blocks take half the bytes
        assert llm.engine.kv_bytes_per_token() * 2 == one.engine.kv_bytes_per_token()
        assert llm.engine.runner.kv_cache_bytes * 2 == one.engine.runner.kv_cache_bytes
        timeline = llm.engine.pipeline_stats()
        workers = llm.engine.parallel.workers
    finally:
        llm.engine.shutdown()
    assert [w.exitcode for w in workers] == [0]
    assert len(timeline.steps) == llm.engine.core.num_steps  # every step that ran, on both stages
    assert max(step.num_micro_batches for step in timeline.steps) == num_micro_batches
    for step in timeline.steps:
        first, last = step.spans
        assert len(first) == len(last)
        for spans in step.spans:  # a stage works on one micro-batch at a time, in order
            assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
        # stage 1 starts a micro-batch only once stage 0 has finished it (one clock for every process)
        assert all(finished <= started for (_, finished), (started, _) in zip(first, last))


def test_a_stage_that_dies_fails_the_engine_with_a_clear_error():
    llm = LLM(pipeline_parallel_size=2, **TIGHT)
    worker = llm.engine.parallel.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(RankFailure, match=r"pipeline parallelism: rank\(s\) \{1: -9\}.*start a new one"):
        llm.generate(PROMPTS[:2], GREEDY)
    with pytest.raises(RankFailure):  # and at once afterwards, without waiting on a timeout
        llm.generate(PROMPTS[:1], GREEDY)
    llm.engine.shutdown()
    assert not worker.is_alive()


def test_what_a_pipeline_cannot_do_yet_is_refused_before_any_stage_starts(one_process):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=5 does not fit a model of 4 layers.*1 … 4"):
        LLM(pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="cannot both be > 1"):
        LLM(pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 runs eager.*compile_model and speculative"):
        LLM(pipeline_parallel_size=2, compile_model=True)
    with pytest.raises(ValueError, match="num_micro_batches .* set pipeline_parallel_size > 1"):
        LLM(num_micro_batches=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer ≥ 1"):
        LLM(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_stats needs a pipeline"):
        one_process("recompute")[0].engine.pipeline_stats()


def test_minserve_serve_with_two_stages_answers_an_openai_client_as_one_process_does(one_process):
    import openai

    from minserve.serve.launch import ServerProcess
    from tests.test_tensor_parallel import _descendants_of

    prompt = "def fibonacci(n):"
    reference = one_process("recompute")[0].generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    with ServerProcess(["--pipeline-parallel-size", "2", "--num-micro-batches", "2", "--dtype", "float32"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.completions.create(model="minserve-tiny", prompt=prompt, max_tokens=12, temperature=0)
        started = _descendants_of(server.pid)
    assert reply.choices[0].text == reference[0].text
    assert len(started) >= 2  # the engine core, and the stage it started
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker takes a moment to notice
    while (left := [pid for pid in started if pathlib.Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left  # the core, its stage and the tracker all stopped with the server


@pytest.mark.slow
def test_three_stages_pass_hidden_states_through_a_middle_stage(one_process):
    """Four layers in three stages (2, 1, 1): stage 1 receives from stage 0 and sends to stage 2, which sends
    the logits back to rank 0."""
    one, expected = one_process("recompute")
    llm = LLM(pipeline_parallel_size=3, num_micro_batches=3, **TIGHT)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert llm.stats()["kv_blocks_used"] == 0
        assert llm.engine.kv_bytes_per_token() * 2 == one.engine.kv_bytes_per_token()  # stage 0 has 2 of 4 layers
        assert max(step.num_micro_batches for step in llm.engine.pipeline_stats().steps) == 3
    finally:
        llm.engine.shutdown()

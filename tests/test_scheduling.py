"""Scheduling: chunked prefill, policies, starvation and aging, preemption victims, deadlines, queue delay.

The engine tests run the real model; the starvation and victim tests run the real scheduler and block
manager with a stand-in for the model (tests/stand_in.py), thousands of steps in milliseconds. Every
assertion is on tokens and steps, never on wall-clock time.
"""

from __future__ import annotations

import itertools

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.block_manager import BlockManager
from minserve.engine.policies import FCFS, PriorityFirst, ShortestPromptFirst, StaticBatching, make_policy
from minserve.engine.scheduler import Scheduler
from tests import stand_in

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):",
    "class Stack:\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description='a tool')",
    "for line in open(path):",
    "try:\n    import json\nexcept ImportError:",
]


@pytest.fixture(scope="module")
def baseline():
    """FCFS without chunking, on a budget every prompt fits in: the outputs everything else must equal."""
    llm = LLM(enable_chunked_prefill=False, max_num_batched_tokens=512, num_kv_blocks=128, block_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "spf", "static"])
@pytest.mark.parametrize("chunked", [True, False])
def test_every_policy_with_or_without_chunking_gives_the_same_greedy_outputs(baseline, policy, chunked):
    # A 12-token budget chunks every prompt but the shortest; 24 blocks of 8 force preemptions as well.
    llm = LLM(scheduling_policy=policy, enable_chunked_prefill=chunked, max_num_batched_tokens=12,
              num_kv_blocks=24, block_size=8, max_num_seqs=4)  # fmt: skip
    priorities = [3, 1, 2, 0, 1, 2]
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), priority=priorities)
    assert [o.token_ids for o in outputs] == baseline
    assert llm.stats()["kv_blocks_used"] == 0


def _step_tokens_while_decoding(chunked: bool) -> tuple[list[int], int]:
    """Two requests decode; then a 300-token prompt arrives. Tokens each step ran while the first request was
    decoding, and the largest number of steps between two of its tokens."""
    budget = 32
    llm = LLM(enable_chunked_prefill=chunked, max_num_batched_tokens=budget, num_kv_blocks=128, block_size=8)
    engine = llm.engine
    engine.add_request("def fibonacci(n):", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "short")
    engine.add_request("class Stack:", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "other")
    steps_with_token, step_tokens, step = [], [], 0
    long_prompt = list(range(3, 303))
    while engine.has_unfinished_requests():
        if step == 5:  # both are decoding by now
            engine.add_request(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True), "long")
        batch_tokens = []
        original = engine.core.scheduler.schedule

        def spy(original=original, batch_tokens=batch_tokens):
            batch = original()
            batch_tokens.append(batch.num_tokens)
            return batch

        engine.core.scheduler.schedule = spy
        outputs = engine.step()
        engine.core.scheduler.schedule = original
        step += 1
        if any(o.request_id == "short" for o in outputs):
            steps_with_token.append(step)
            step_tokens += batch_tokens
    gaps = [b - a for a, b in itertools.pairwise(steps_with_token)]
    return step_tokens, max(gaps)


def test_chunked_prefill_bounds_each_step_by_the_budget_while_others_decode():
    chunked_tokens, chunked_gap = _step_tokens_while_decoding(chunked=True)
    whole_tokens, whole_gap = _step_tokens_while_decoding(chunked=False)
    # With chunks, no step that gave the decoding request its token ran more than the 32-token budget: the
    # 300-token prompt went through in chunks beside it. Without, one step ran the whole prompt at once.
    assert max(chunked_tokens) <= 32
    assert max(whole_tokens) >= 300
    assert chunked_gap == whole_gap == 1  # a token every step either way: the cost is in the step's length


def test_static_batching_admits_nobody_into_a_running_batch():
    block_manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=64, policy="static")
    first = [stand_in.make_sequence(i, [1, 2, 3], max_tokens=5 + i) for i in range(2)]
    for seq in first:
        scheduler.add(seq)
    stand_in.step(scheduler)
    late = stand_in.make_sequence(9, [4, 5], max_tokens=2)
    scheduler.add(late)
    while first[1] in scheduler.running:
        batch, _ = stand_in.step(scheduler)
        assert late not in batch.seqs  # the batch runs to completion first
    batch, _ = stand_in.step(scheduler)
    assert batch.seqs == [late]


def _finish_step_of_long_request(policy, num_steps: int = 1000) -> int | None:
    """Short requests (8-token prompts) arrive three a step, more than the engine serves (about two a step);
    at step 10 a 64-token prompt arrives among them. The step at which it finishes, or None if it never
    does within ``num_steps``."""
    block_manager = BlockManager(num_blocks=256, block_size=8)
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=24, policy=policy)
    long = None
    arrivals = 0
    for step in range(1, num_steps + 1):
        if step == LONG_ARRIVES:
            long = stand_in.make_sequence(arrivals, list(range(64)), max_tokens=2)
            scheduler.add(long)
            arrivals += 1
        for _ in range(3):
            scheduler.add(stand_in.make_sequence(arrivals, list(range(8)), max_tokens=2))
            arrivals += 1
        _, finished = stand_in.step(scheduler)
        if long in finished:
            return step
    return None


LONG_ARRIVES = 10


def test_shortest_prompt_first_starves_a_long_prompt_without_aging_and_not_with_it():
    # Without aging a shorter prompt is always waiting, so the long one never runs.
    assert _finish_step_of_long_request(ShortestPromptFirst(aging_tokens_per_step=0.0)) is None
    # With aging a, the long prompt outranks every short one that arrives more than (64 − 8) / a steps after
    # it: it waits behind at most the 3 · (10 + 56) shorts that came before, served at about 2 a step.
    aging = 1.0
    finished_at = _finish_step_of_long_request(ShortestPromptFirst(aging_tokens_per_step=aging))
    bound = LONG_ARRIVES + 3 * (LONG_ARRIVES + (64 - 8) / aging) / 2 + 10
    assert finished_at is not None and finished_at <= bound, (finished_at, bound)
    # First come, first served: behind only the shorts that arrived before it.
    assert _finish_step_of_long_request(FCFS()) <= LONG_ARRIVES + 3 * LONG_ARRIVES / 2 + 10


def test_the_policy_chooses_the_preemption_victim():
    # Three running requests grow until memory runs out; the one the policy ranks last is preempted.
    for policy, expected_victim in ((FCFS(), "2"), (PriorityFirst(), "0")):
        block_manager = BlockManager(num_blocks=9, block_size=2)
        scheduler = Scheduler(block_manager, max_num_seqs=3, max_num_batched_tokens=64, policy=policy)
        seqs = [stand_in.make_sequence(i, [1, 2, 3, 4], max_tokens=20, priority=[5, 1, 0][i]) for i in range(3)]
        for seq in seqs:
            scheduler.add(seq)
        preempted = []
        for _ in range(10):
            batch, _ = stand_in.step(scheduler)
            preempted += [seq.request_id for seq in batch.preempted]
            block_manager.check_invariants([*scheduler.running, *scheduler.waiting])
        assert preempted and preempted[0] == expected_victim, (policy, preempted)


def test_policies_by_name():
    assert isinstance(make_policy("static"), StaticBatching) and make_policy("fcfs").name == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_policy("lifo")


def test_a_request_past_its_deadline_is_stopped_and_reported():
    llm = LLM(num_kv_blocks=160, block_size=16)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    slow, quick = llm.generate(
        ["def slow():", "x = 1"], [params, SamplingParams(max_tokens=3)], deadline_s=[0.05, None]
    )
    assert slow.finish_reason == "deadline" and 0 < len(slow.token_ids) < 2000
    assert quick.finish_reason in ("stop", "length")
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.core.requests
    assert [e.name for e in llm.tracer.for_request(slow.request_id)][-1] == "deadline"
    with pytest.raises(ValueError, match="deadline_s"):
        llm.generate("x", deadline_s=-1.0)


def test_metrics_split_each_request_into_waiting_and_running():
    # One sequence at a time: the later requests wait for the earlier ones, and it shows in waiting_s.
    llm = LLM(max_num_seqs=1, num_kv_blocks=64, block_size=8)
    outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for out in outputs:
        m = out.metrics
        assert m.waiting_s >= m.queue_s >= 0
        assert m.running_s == pytest.approx(m.e2e_s - m.waiting_s)
    waits = [out.metrics.waiting_s for out in outputs]
    assert waits[0] < waits[1] < waits[2]  # each waited for those before it


def test_swap_preemption_moves_kv_to_host_and_back():
    block_manager = BlockManager(num_blocks=9, block_size=2, num_cpu_blocks=16)
    scheduler = Scheduler(block_manager, max_num_seqs=3, max_num_batched_tokens=64, preemption_mode="swap")
    seqs = [stand_in.make_sequence(i, [1, 2, 3, 4], max_tokens=6) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    swapped_out = swapped_in = 0
    while scheduler.has_unfinished():
        batch, _ = stand_in.step(scheduler)
        swapped_out += len(batch.swap_out)
        swapped_in += len(batch.swap_in)
        block_manager.check_invariants([*scheduler.running, *scheduler.waiting, *scheduler.swapped])
    assert swapped_out > 0 and swapped_in == swapped_out  # every block that went out came back
    assert all(len(seq.output_token_ids) == 6 for seq in seqs)  # nothing recomputed from scratch was lost
    assert block_manager.num_free_blocks == 9 and len(block_manager.free_cpu_blocks) == 16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_resume_with_the_uninterrupted_output(baseline, mode):
    # 10 blocks of 8 tokens for 6 requests of up to ~30 tokens each: preemption is certain.
    llm = LLM(preemption_mode=mode, num_kv_blocks=10, block_size=8, max_num_seqs=6, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in outputs] == baseline
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
    modes = {e.args["mode"] for e in llm.tracer.events if e.name == "preempted"}
    assert modes == {mode}
    assert len(llm.engine.core.block_manager.free_cpu_blocks) == llm.engine.core.block_manager.num_cpu_blocks

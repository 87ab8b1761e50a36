"""Graded tests for chapter 05 (``minserve grade ch05``). Each test's docstring is the hint a learner sees.

Part 1 checks the step counts by hand and, with hypothesis, against the real scheduler run in the simulator
with a step-cost model of exactly 1 second per step (its virtual clock then counts steps). Part 2 puts the
learner's policy into the real :class:`~minserve.engine.scheduler.Scheduler`: its key on hand-made
sequences; goodput in the simulator against FCFS on a fixed, seeded workload with a fixed step-cost model (the
coefficients calibrated on the embedded model on a CPU, rounded; nothing here reads a clock); a long request
under a steady overload of short ones, counted in steps; and once on the real engine, whose greedy outputs
must not depend on the policy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import LLM, SamplingParams, slo
from minserve import exercise_harness as harness
from minserve.capacity.experiments import TINY_CPU_COST
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator, StepCostModel, make_requests
from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.outputs import RequestMetrics
from minserve.engine.policies import Policy
from minserve.engine.sampling_params import SamplingParams as Params
from minserve.engine.sequence import Sequence

PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ONE_SECOND_PER_STEP = StepCostModel({"base": 1.0})
CPU_COST = TINY_CPU_COST  # minserve-tiny's measured step costs on a 2-core CPU


class _NoText:
    def decode(self, token_ids, skip_special_tokens=True):
        return ""


def _seq(arrival: int, prompt_tokens: int, computed: int = 0, outputs: int = 0, waited: int = 0) -> Sequence:
    """A request as the scheduler holds it: ``computed`` of its tokens in the KV cache, ``waited`` steps waited."""
    seq = Sequence(
        request_id=str(arrival),
        prompt=None,
        prompt_token_ids=list(range(1, prompt_tokens + 1)),
        params=Params(max_tokens=100, ignore_eos=True),
        metrics=RequestMetrics(arrival_time_s=0.0),
        detokenizer=IncrementalDetokenizer(_NoText()),
        arrival_index=arrival,
    )
    seq.output_token_ids = [7] * outputs
    seq.num_computed_tokens = computed
    seq.steps_waited = waited
    return seq


def _order(policy: Policy, seqs: list[Sequence]) -> list[str]:
    return [seq.request_id for seq in sorted(seqs, key=policy.key)]


def _steps_in_scheduler(output_lengths: list[int], batch_size: int, policy: str) -> float:
    """The real scheduler's step count: every request at once, 4-token prompts, an ample budget and memory."""
    requests = [SimRequest(0.0, (1, 2, 3, 4), n, request_id=str(i)) for i, n in enumerate(output_lengths)]
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=4096, num_kv_blocks=4096,
                       scheduling_policy=policy, enable_prefix_caching=False)  # fmt: skip
    return Simulator(ONE_SECOND_PER_STEP, config).run(requests).end_s


# --- part 1: counting steps ---------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_static_batching_steps(exercise):
    """Cut the list into consecutive batches of batch_size; each batch takes as many steps as its longest output."""
    assert exercise.static_batching_steps([3, 1, 4, 1, 5], 2) == 12
    assert exercise.static_batching_steps([3, 1, 4, 1, 5], 5) == 5
    assert exercise.static_batching_steps([3, 1, 4, 1, 5], 1) == 14
    assert exercise.static_batching_steps([], 4) == 0
    for bad in (([1, 2], 0), ([1, 0], 2)):
        with pytest.raises(ValueError):
            exercise.static_batching_steps(*bad)


@pytest.mark.points(1)
def test_continuous_batching_steps_by_hand(exercise):
    """Give each request, in order, the seat that frees up first (a heap of seat-free steps); the answer is the
    step the last seat frees."""
    assert exercise.continuous_batching_steps([3, 1, 4, 1, 5], 2) == 9
    assert exercise.continuous_batching_steps([3, 1, 4, 1, 5], 5) == 5
    assert exercise.continuous_batching_steps([3, 1, 4, 1, 5], 1) == 14
    # A long request in every batch of four: static batching runs the four one after another, each beside
    # three seats that empty after a step; continuous batching runs them side by side, the shorts in between.
    outputs = [100, 1, 1, 1] * 4
    assert exercise.static_batching_steps(outputs, 4) == 400
    assert exercise.continuous_batching_steps(outputs, 4) == 106
    assert exercise.continuous_batching_steps([], 4) == 0
    with pytest.raises(ValueError):
        exercise.continuous_batching_steps([1, 2], 0)


@pytest.mark.points(2)
@PROPERTY
@given(outputs=st.lists(st.integers(1, 12), min_size=1, max_size=24), batch_size=st.integers(1, 6))
def test_step_counts_match_the_real_scheduler(exercise, outputs, batch_size):
    """Your counts must equal the real scheduler's: FCFS refills a seat the step after it frees; static waits."""
    static = exercise.static_batching_steps(outputs, batch_size)
    continuous = exercise.continuous_batching_steps(outputs, batch_size)
    assert static == _steps_in_scheduler(outputs, batch_size, "static")
    assert continuous == _steps_in_scheduler(outputs, batch_size, "fcfs")
    assert continuous <= static


@pytest.mark.points(1)
def test_aging_bound_steps(exercise):
    """(long − short) / aging steps; 0.0 if the long one is not longer; math.inf with no aging; ValueError for
    a negative aging or an empty prompt."""
    assert exercise.aging_bound_steps(1024, 24, 4.0) == pytest.approx(250.0)
    assert exercise.aging_bound_steps(64, 8, 1.0) == pytest.approx(56.0)
    assert exercise.aging_bound_steps(8, 64, 1.0) == 0.0
    assert exercise.aging_bound_steps(64, 64, 0.0) == 0.0
    assert exercise.aging_bound_steps(65, 64, 0.0) == math.inf
    for bad in ((64, 8, -1.0), (0, 8, 1.0), (64, 0, 1.0)):
        with pytest.raises(ValueError):
            exercise.aging_bound_steps(*bad)


# --- part 2: the policy -------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_key_orders_by_remaining_work_then_arrival(exercise):
    """Key on seq.num_uncomputed_tokens (what is left to compute), then seq.arrival_index for ties: return a tuple."""
    policy = exercise.FairShortestFirst(aging_tokens_per_step=0.0)
    assert isinstance(policy, Policy) and policy.admits_while_running
    fresh = [_seq(0, 500), _seq(1, 20), _seq(2, 100), _seq(3, 20)]
    assert _order(policy, fresh) == ["1", "3", "2", "0"]  # shortest first; equal lengths by arrival
    assert isinstance(policy.key(fresh[0]), tuple)
    # A 1000-token prompt with 990 tokens prefilled has 10 left: it goes before a fresh 20-token prompt.
    # A decode (one token to compute) goes before both; one preempted by recompute counts all its tokens.
    half_done = _seq(4, 1000, computed=990)
    decoding = _seq(5, 300, computed=309, outputs=10)
    recomputing = _seq(6, 10, computed=0, outputs=30)
    assert _order(policy, [fresh[1], half_done, decoding, recomputing]) == ["5", "4", "1", "6"]


@pytest.mark.points(2)
def test_key_ages_waiting_requests(exercise):
    """Subtract aging_tokens_per_step × seq.steps_waited from the remaining tokens; reject a negative aging."""
    policy = exercise.FairShortestFirst(aging_tokens_per_step=2.0)
    newcomer = _seq(9, 24)  # arrived last, has not waited
    # 1024 − 2 × 499 = 26 > 24: still behind the newcomer; 1024 − 2 × 500 = 24: a tie, and it arrived first.
    assert _order(policy, [newcomer, _seq(0, 1024, waited=499)]) == ["9", "0"]
    assert _order(policy, [newcomer, _seq(0, 1024, waited=500)]) == ["0", "9"]
    assert _order(policy, [newcomer, _seq(0, 1024, waited=900)]) == ["0", "9"]
    without = exercise.FairShortestFirst(aging_tokens_per_step=0.0)
    assert _order(without, [newcomer, _seq(0, 1024, waited=10**6)]) == ["9", "0"]  # no aging: never
    assert exercise.FairShortestFirst().aging_tokens_per_step == 1.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            exercise.FairShortestFirst(aging_tokens_per_step=bad)


def _mixed_requests(num_requests: int, rate_rps: float, seed: int) -> list[SimRequest]:
    """Poisson arrivals; 80% prompts of 16–64 tokens, 20% of 768–1536; outputs of 16–64 tokens."""
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_requests) < 0.2
    prompts = np.where(is_long, rng.integers(768, 1537, num_requests), rng.integers(16, 65, num_requests))
    outputs = rng.integers(16, 65, num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate_rps, num_requests - 1))])
    return make_requests(arrivals.tolist(), prompts.tolist(), outputs.tolist(), seed=seed)


GOODPUT_CONFIG = dict(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=2048, max_model_len=2048)
INTERACTIVE = slo.SLO(name="interactive", ttft_s=0.5, tpot_s=0.05)


def _goodput(policy, requests) -> float:
    result = Simulator(CPU_COST, SchedulerConfig(**GOODPUT_CONFIG, scheduling_policy=policy)).run(requests)
    assert len(result.requests) == len(requests) and all(r.finish_reason == "length" for r in result.requests)
    return slo.goodput_rps(result.records, INTERACTIVE)


@pytest.mark.points(3)
def test_goodput_beats_fcfs(exercise):
    """Near capacity, FCFS makes short prompts wait behind long ones; shortest-first (mildly aged, the default
    1 token per step) must serve ≥ 1.5 × FCFS's goodput. Too strong an aging turns it back into FCFS."""
    requests = _mixed_requests(500, rate_rps=10.0, seed=1)  # about the capacity of this engine and workload
    fcfs = _goodput("fcfs", requests)
    mine = _goodput(exercise.FairShortestFirst(), requests)
    assert mine >= 1.5 * fcfs, f"goodput {mine:.2f} requests/s against FCFS's {fcfs:.2f}"


def _long_request_finish_step(policy: Policy, stream_steps: int = 400, long_arrives: int = 10) -> float:
    """Short requests (8-token prompts) arrive three a step for ``stream_steps`` steps, more than the engine
    serves (about two a step); a 64-token prompt arrives at step ``long_arrives``. The step its last token
    comes at (the simulator's clock counts steps)."""
    requests = [SimRequest(k / 3, tuple(range(1, 9)), 2, request_id=f"short{k}") for k in range(3 * stream_steps)]
    requests.append(SimRequest(float(long_arrives), tuple(range(1, 65)), 2, request_id="long"))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, num_kv_blocks=256, block_size=8,
                       scheduling_policy=policy)  # fmt: skip
    result = Simulator(ONE_SECOND_PER_STEP, config).run(requests)
    (long,) = [r for r in result.requests if r.request_id == "long"]
    return long.metrics.finish_time_s


@pytest.mark.points(3)
def test_no_starvation(exercise):
    """With aging, a long prompt outranks every short one that arrives (64 − 8) / aging steps after it: it waits
    behind a bounded number of them, however long the stream goes on."""
    finish = _long_request_finish_step(exercise.FairShortestFirst(aging_tokens_per_step=1.0))
    # Behind at most the 3 × (10 + 56) shorts that came before it or within 56 steps after, served ~2 a step.
    assert finish <= 10 + 3 * (10 + 56) / 2 + 20, f"the long request finished at step {finish:.0f}"
    assert _long_request_finish_step(exercise.FairShortestFirst(aging_tokens_per_step=4.0)) < finish


@pytest.mark.points(1)
def test_without_aging_the_long_request_starves(exercise):
    """With aging 0 a shorter request is always waiting, so the long one runs only once the stream has ended."""
    assert _long_request_finish_step(exercise.FairShortestFirst(aging_tokens_per_step=0.0)) > 400


PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):",
    "class Stack:\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description='a tool')",
    "for line in open(path):",
]


@pytest.mark.points(1)
def test_same_outputs_on_the_real_engine(exercise):
    """A policy only reorders work: on the real engine, chunked and preempting, greedy outputs equal FCFS's."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    small = dict(max_num_batched_tokens=12, num_kv_blocks=20, block_size=8, max_num_seqs=4, num_threads=1)
    expected = [o.token_ids for o in LLM(**small).generate(PROMPTS, params)]
    llm = LLM(scheduling_policy=exercise.FairShortestFirst(), **small)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert llm.stats()["kv_blocks_used"] == 0


# --- part 3: the scheduler's step -------------------------------------------------------------------------
# The learner's StepScheduler takes the place of the engine's Scheduler (minserve.exercise_harness), in the
# simulator on its virtual clock and once in the real engine. After every step the block manager's own
# invariants are checked (no block leaked, double-freed or owned twice), and at the end every block is free.

REFERENCE = harness.REFERENCE_SCHEDULER


def _steps(exercise, config: SchedulerConfig, requests: list[SimRequest], cost=ONE_SECOND_PER_STEP):
    """Run the learner's scheduler; return the result and, per step, the (request id, tokens) it scheduled."""
    steps: list[list[tuple[str, int]]] = []
    record = lambda _, report: steps.append([(s.request_id, s.num_new_tokens) for s in report.scheduled])  # noqa: E731
    result = harness.simulate(exercise.StepScheduler, cost, config, requests, on_step=record)
    for request, done in zip(sorted(requests, key=lambda r: r.arrival_s), result.requests):
        assert done.finish_reason == "length" and done.output_tokens == request.output_tokens, done
    return result, steps


def _short_and_long(num_short: int, short_prompt: int, long_prompt: int, seed: int) -> list[SimRequest]:
    """``num_short`` requests of ``short_prompt`` tokens at times 0, 1, 2, …, one long prompt among them."""
    rng = np.random.default_rng(seed)
    prompts = [int(rng.integers(short_prompt // 2, short_prompt + 1)) for _ in range(num_short)]
    prompts.insert(num_short // 2, long_prompt)
    outputs = [int(rng.integers(4, 24)) for _ in prompts]
    return make_requests([float(i) for i in range(len(prompts))], prompts, outputs, seed=seed)


@pytest.mark.points(4)
def test_scheduler_keeps_the_token_budget_and_the_seats(exercise):
    """Each step: at most max_num_batched_tokens tokens and max_num_seqs sequences, each sequence once; every
    request ends with all its tokens. Serve running sequences before admitting waiting ones."""
    config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=48, num_kv_blocks=96, block_size=8)
    _, steps = _steps(exercise, config, _short_and_long(30, 40, 150, seed=3))
    for scheduled in steps:
        ids = [request_id for request_id, _ in scheduled]
        assert len(ids) == len(set(ids)) <= 5, scheduled
        assert 0 < sum(n for _, n in scheduled) <= 48, scheduled


@pytest.mark.points(4)
def test_a_long_prompt_is_chunked_beside_the_decodes(exercise):
    """A prompt longer than the budget runs in chunks over several steps (no step over the budget), and the
    decodes already running keep getting their token every step meanwhile."""
    decoders = [SimRequest(0.0, tuple(range(1, 9)), 30, request_id=f"d{i}") for i in range(4)]
    long = SimRequest(3.0, tuple(range(100, 340)), 2, request_id="long")
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=128, block_size=8)
    result, steps = _steps(exercise, config, [*decoders, long])
    long_chunks = [n for scheduled in steps for request_id, n in scheduled if request_id == "long"]
    assert len(long_chunks) >= 240 // 32 + 1 and max(long_chunks) <= 32, long_chunks
    assert harness.p99_itl_s(result, [f"d{i}" for i in range(4)]) == 1.0  # one step between any two tokens


@pytest.mark.points(3)
def test_admission_waits_for_free_blocks(exercise):
    """Admit a waiting request only when the block manager has the blocks its first chunk needs; otherwise it
    waits (never call allocate without asking can_allocate: NoFreeBlocksError)."""
    requests = make_requests([0.0] * 12, 60, 10, seed=4)  # 70 tokens each: 9 blocks of 8; 3 fit in 32
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=256, num_kv_blocks=32, block_size=8)
    _, steps = _steps(exercise, config, requests)
    assert max(len(scheduled) for scheduled in steps) < 12  # memory, not seats, held them back


@pytest.mark.points(4)
def test_preempts_when_blocks_run_out_and_nothing_leaks(exercise):
    """When a running sequence needs a block and none is free, preempt (by recompute: free its blocks, send it
    back to waiting, keep its tokens) the running sequence the policy ranks last; it finishes later."""
    requests = make_requests([0.0] * 8, 20, 60, seed=5)  # they fit at first, then outgrow 40 blocks
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=40, block_size=8)
    result, _ = _steps(exercise, config, requests)
    assert result.num_preemptions > 0


@pytest.mark.points(2)
def test_a_shared_prefix_keeps_the_block_accounting(exercise):
    """Requests that share a prompt prefix share its cached blocks (find_cached_prefix, share_cached_prefix):
    count the revived free blocks when asking for memory, and the reference counts stay exact."""
    arrivals = [0.5 * i for i in range(16)]
    requests = make_requests(arrivals, 48, 12, seed=6, shared_prefix_tokens=32)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=40, num_kv_blocks=30, block_size=8)
    result, _ = _steps(exercise, config, requests)
    assert sum(r.num_cached_tokens for r in result.requests) > 0


ENGINE_PROMPTS = PROMPTS


@pytest.mark.points(4)
def test_scheduler_gives_the_reference_greedy_outputs_on_the_real_engine(exercise):
    """In the real engine, chunking and preempting, greedy outputs must equal the engine's own scheduler's:
    a scheduler decides when tokens run, never what they are. No block may be left held."""
    small = dict(max_num_batched_tokens=12, num_kv_blocks=9, block_size=8, max_num_seqs=4, num_threads=1)
    tokens, preemptions = harness.greedy_tokens(exercise.StepScheduler, ENGINE_PROMPTS, 16, **small)
    expected, _ = harness.greedy_tokens(REFERENCE, ENGINE_PROMPTS, 16, **small)
    assert tokens == expected
    assert preemptions > 0


def _decoders_and_a_long_prompt(num_decoders: int, output_tokens: int, long_prompt: int) -> list[SimRequest]:
    decoders = make_requests([0.0] * num_decoders, 16, output_tokens, seed=7)
    return [*decoders, SimRequest(0.2, tuple(range(1, long_prompt + 1)), 4, request_id="long")]


@pytest.mark.points(4)
def test_p99_itl_under_a_long_prompt_arrival(exercise):
    """When a 3000-token prompt arrives among running decodes, their p99 inter-token latency (on the
    simulator's virtual clock, chunk costs from the embedded model's CPU cost model) must stay within
    1.25 × the reference scheduler's: prefill it in chunks of the budget, never whole."""
    requests = _decoders_and_a_long_prompt(8, 60, 3000)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512, max_model_len=4096)
    ids = [r.request_id for r in requests[:-1]]
    mine = harness.p99_itl_s(harness.simulate(exercise.StepScheduler, CPU_COST, config, requests), ids)
    reference = harness.p99_itl_s(harness.simulate(REFERENCE, CPU_COST, config, requests), ids)
    assert mine <= 1.25 * reference, f"p99 ITL {mine * 1e3:.1f} ms against the reference's {reference * 1e3:.1f} ms"


@pytest.mark.points(3)
def test_goodput_at_least_the_references_on_a_mixed_workload(exercise):
    """On the mixed workload near capacity (a fifth of the prompts ~30 × longer), goodput under the
    interactive SLO must be at least 0.95 × the reference scheduler's (same policy, FCFS)."""
    requests = _mixed_requests(300, rate_rps=10.0, seed=1)
    config = SchedulerConfig(**GOODPUT_CONFIG)
    mine = harness.simulate(exercise.StepScheduler, CPU_COST, config, requests, False)  # blocks: checked above
    mine = harness.goodput_rps(mine, INTERACTIVE)
    reference = harness.goodput_rps(harness.simulate(REFERENCE, CPU_COST, config, requests, False), INTERACTIVE)
    assert mine >= 0.95 * reference, f"goodput {mine:.2f} requests/s against the reference's {reference:.2f}"

"""Chapter 05's hidden tests (``minserve grade ch05 --hidden``): the public tests' checks on other shapes,
seeds and workloads, so a file fitted to the public tests does not pass these. Instructors only: this file
sits under ``exercises/solutions/``, which the learner's copy of the course never holds.

Every number comes from the simulator's virtual clock or from step counts; nothing reads a wall clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from minserve import exercise_harness as harness
from minserve import slo
from minserve.capacity.experiments import TINY_CPU_COST
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator, StepCostModel, make_requests

ONE_SECOND_PER_STEP = StepCostModel({"base": 1.0})
REFERENCE = harness.REFERENCE_SCHEDULER
INTERACTIVE = slo.SLO(name="interactive", ttft_s=0.5, tpot_s=0.05)


def _steps_in_scheduler(output_lengths: list[int], batch_size: int, policy: str) -> float:
    requests = [SimRequest(0.0, (5, 6, 7), n, request_id=str(i)) for i, n in enumerate(output_lengths)]
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=4096, num_kv_blocks=4096,
                             scheduling_policy=policy, enable_prefix_caching=False)  # fmt: skip
    return Simulator(ONE_SECOND_PER_STEP, config).run(requests).end_s


@pytest.mark.points(2)
def test_step_counts_on_other_batches(exercise):
    """Static and continuous batching step counts, checked against the real scheduler on other lengths."""
    rng = np.random.default_rng(11)
    for batch_size in (1, 3, 7):
        outputs = rng.integers(1, 30, int(rng.integers(1, 40))).tolist()
        assert exercise.static_batching_steps(outputs, batch_size) == _steps_in_scheduler(outputs, batch_size, "static")
        assert exercise.continuous_batching_steps(outputs, batch_size) == _steps_in_scheduler(
            outputs, batch_size, "fcfs"
        )
    assert exercise.aging_bound_steps(300, 20, 7.0) == pytest.approx(40.0)


def _mixed(num_requests: int, rate_rps: float, seed: int, long_share: float = 0.25) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_requests) < long_share
    prompts = np.where(is_long, rng.integers(600, 1200, num_requests), rng.integers(12, 48, num_requests))
    outputs = rng.integers(8, 48, num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate_rps, num_requests - 1))])
    return make_requests(arrivals.tolist(), prompts.tolist(), outputs.tolist(), seed=seed)


@pytest.mark.points(2)
def test_policy_goodput_on_another_workload(exercise):
    """Aged shortest-first serves ≥ 1.3 × FCFS's goodput on another mixed workload and seed, near capacity."""
    config = dict(max_num_seqs=12, max_num_batched_tokens=192, num_kv_blocks=2048, max_model_len=2048)
    requests = _mixed(300, rate_rps=15.0, seed=23)  # near this engine's capacity for the workload

    def goodput(policy) -> float:
        result = Simulator(TINY_CPU_COST, SchedulerConfig(**config, scheduling_policy=policy)).run(requests)
        return slo.goodput_rps(result.records, INTERACTIVE)

    assert goodput(exercise.FairShortestFirst()) >= 1.3 * goodput("fcfs")


def _run(exercise, config: SchedulerConfig, requests: list[SimRequest]):
    steps: list[list[tuple[str, int]]] = []
    record = lambda _, report: steps.append([(s.request_id, s.num_new_tokens) for s in report.scheduled])  # noqa: E731
    result = harness.simulate(exercise.StepScheduler, ONE_SECOND_PER_STEP, config, requests, on_step=record)
    for request, done in zip(sorted(requests, key=lambda r: r.arrival_s), result.requests):
        assert done.finish_reason == "length" and done.output_tokens == request.output_tokens, done
    return result, steps


@pytest.mark.points(3)
@pytest.mark.parametrize("block_size, budget, seats", [(4, 20, 3), (32, 100, 9)])
def test_budget_seats_and_blocks_on_other_shapes(exercise, block_size, budget, seats):
    """The budget, the seats and the block invariants on other block sizes, budgets and seat counts, with
    preemption (memory for about half the load) and a shared prefix."""
    rng = np.random.default_rng(block_size)
    arrivals = np.cumsum(rng.exponential(0.5, 40)).tolist()
    prompts = rng.integers(4, 6 * block_size, 40).tolist()
    requests = make_requests(arrivals, prompts, rng.integers(2, 40, 40).tolist(), seed=31,
                             shared_prefix_tokens=block_size)  # fmt: skip
    need = max(-(-(p + 40) // block_size) for p in prompts)
    config = SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=budget, block_size=block_size,
                             num_kv_blocks=max(need, seats * need // 2))  # fmt: skip
    _, steps = _run(exercise, config, requests)
    for scheduled in steps:
        ids = [request_id for request_id, _ in scheduled]
        assert len(ids) == len(set(ids)) <= seats and 0 < sum(n for _, n in scheduled) <= budget, scheduled


@pytest.mark.points(2)
def test_policy_order_reaches_the_step(exercise):
    """The scheduler admits in the policy's order: with "priority", the urgent request arriving last runs
    before the ones queued ahead of it."""
    requests = [SimRequest(0.0, tuple(range(1, 40)), 3, priority=5, request_id=f"r{i}") for i in range(4)]
    requests.append(SimRequest(0.0, tuple(range(50, 90)), 3, priority=0, request_id="urgent"))
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=64, block_size=8,
                             scheduling_policy="priority")  # fmt: skip
    _, steps = _run(exercise, config, requests)
    assert steps[0][0][0] == "urgent", steps[0]


HIDDEN_PROMPTS = [
    "The quick brown fox",
    "def quicksort(items):\n    if len(items) <= 1:",
    "SELECT name, count(*) FROM users",
    "Once upon a time, in a small village by the sea, there lived",
    "x = [i * i for i in range(10)]\nprint(",
    "import numpy as np\n",
]


@pytest.mark.points(3)
def test_same_greedy_outputs_with_other_shapes(exercise):
    """On the real engine with blocks of 4, a budget of 7 and 3 seats (chunking, preempting), greedy outputs
    equal the engine's scheduler's."""
    small = dict(max_num_batched_tokens=7, num_kv_blocks=14, block_size=4, max_num_seqs=3, num_threads=1)
    tokens, preemptions = harness.greedy_tokens(exercise.StepScheduler, HIDDEN_PROMPTS, 12, **small)
    expected, _ = harness.greedy_tokens(REFERENCE, HIDDEN_PROMPTS, 12, **small)
    assert tokens == expected and preemptions > 0


@pytest.mark.points(3)
def test_p99_itl_and_goodput_on_another_workload(exercise):
    """A 2000-token prompt among 12 decodes with a budget of 96: p99 ITL within 1.25 × the reference's; and
    on another mixed workload, goodput at least 0.95 × the reference's."""
    decoders = make_requests([0.0] * 12, 24, 50, seed=41)
    requests = [*decoders, SimRequest(0.05, tuple(range(1, 2001)), 3, request_id="long")]
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96, num_kv_blocks=400, max_model_len=4096)
    ids = [r.request_id for r in decoders]
    mine = harness.p99_itl_s(harness.simulate(exercise.StepScheduler, TINY_CPU_COST, config, requests), ids)
    reference = harness.p99_itl_s(harness.simulate(REFERENCE, TINY_CPU_COST, config, requests), ids)
    assert mine <= 1.25 * reference
    mixed = _mixed(250, rate_rps=8.0, seed=47)
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=192, num_kv_blocks=2048, max_model_len=2048)
    ref_goodput = harness.goodput_rps(harness.simulate(REFERENCE, TINY_CPU_COST, config, mixed, False), INTERACTIVE)
    goodput = harness.goodput_rps(harness.simulate(exercise.StepScheduler, TINY_CPU_COST, config, mixed, False),
                                  INTERACTIVE)  # fmt: skip
    assert goodput >= 0.95 * ref_goodput

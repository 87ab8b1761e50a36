"""What the graded tests of chapters 05 and 07 run a learner's piece on: the real engine and its simulator.

Public and hidden tests (``exercises/tests/``, an instructor's ``exercises/solutions/hidden/``) share these
helpers, so a hidden test differs from a public one only in its shapes, seeds and workloads.

Chapter 05: a learner's scheduler takes the engine's place. :func:`scheduler_plugged` makes every
:class:`~minserve.engine.core.EngineCore` built inside it construct the learner's class, with the arguments
the engine's own :class:`~minserve.engine.scheduler.Scheduler` gets (block manager, ``max_num_seqs``,
``max_num_batched_tokens``, ``policy=``, ``enable_chunked_prefill=``, ``preemption_mode=``). Both the offline
:class:`~minserve.LLM` (which builds its core when constructed) and the
:class:`~minserve.capacity.simulator.Simulator` (which builds one per run) then run it unchanged. Passing
the engine's own ``Scheduler`` gives the reference run.

Chapter 07: :func:`replace_linear_weights` puts a learner's quantize/dequantize round trip into every
linear layer of a loaded model, and :func:`agreement_with_float` measures the result against the float
model with chapter 07's own measures (:mod:`minserve.quality.agreement`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch

from minserve import slo
from minserve.capacity.cost_model import StepCost
from minserve.capacity.simulator import SimRequest, SimResult, Simulator
from minserve.config import SchedulerConfig
from minserve.engine import core as engine_core
from minserve.engine.core import EngineCore, StepReport
from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.scheduler import Scheduler
from minserve.quality.agreement import Agreement, next_token_agreement
from minserve.quality.held_out import held_out_text

SchedulerFactory = Callable[..., Any]  # called as the engine calls Scheduler(block_manager, seqs, tokens, …)
REFERENCE_SCHEDULER: SchedulerFactory = Scheduler

# --- chapter 05: a scheduler in the engine's place -----------------------------------------------------------


@contextmanager
def scheduler_plugged(factory: SchedulerFactory) -> Iterator[None]:
    """Inside the block, every engine core built constructs ``factory(...)`` as its scheduler."""
    if not hasattr(engine_core, "Scheduler"):
        raise RuntimeError("minserve.engine.core no longer builds its scheduler by the name Scheduler")
    with mock.patch.object(engine_core, "Scheduler", factory):
        yield


def invariant_checker(core: EngineCore, counts: dict[str, int]) -> Callable[[StepReport], None]:
    """A step observer that checks the block manager's invariants after every step (``AssertionError`` on a
    leaked, double-freed or double-owned block) and counts the steps checked in ``counts["steps"]``."""

    def check(report: StepReport) -> None:
        core.block_manager.check_invariants(core.requests.values())  # the requests still in flight
        counts["steps"] = counts.get("steps", 0) + 1

    return check


def simulate(
    factory: SchedulerFactory,
    cost: StepCost,
    config: SchedulerConfig,
    requests: Sequence[SimRequest],
    check_blocks: bool = True,
    on_step: Callable[[Any, StepReport], None] | None = None,
) -> SimResult:
    """Run ``requests`` through the simulator with ``factory``'s scheduler, on the virtual clock (no wall
    time is read). With ``check_blocks``, the block manager's invariants hold after every step, and at the
    end every block is free again (nothing leaked)."""
    simulator = Simulator(cost, config)
    counts: dict[str, int] = {}
    max_steps = 4 * sum(r.prompt_tokens + r.output_tokens for r in requests) + 1000  # one token a step, twice

    def observe(step: Any, report: StepReport) -> None:
        counts["all"] = counts.get("all", 0) + 1
        assert counts["all"] <= max_steps, f"no end in sight after {max_steps} steps: is a request stuck?"
        if check_blocks:
            invariant_checker(simulator.core, counts)(report)
        if on_step is not None:
            on_step(step, report)

    with scheduler_plugged(factory):
        result = simulator.run(requests, on_step=observe)
    if check_blocks:
        simulator.core.block_manager.check_invariants([])
        held = simulator.core.block_manager.num_used_blocks
        assert held == 0, f"{held} KV blocks are still held after every request finished"
    return result


def greedy_tokens(
    factory: SchedulerFactory, prompts: Sequence[str], max_tokens: int, **llm_options: Any
) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt from the real engine (the embedded model) with ``factory``'s scheduler,
    the block manager's invariants checked after every step; and the number of preemptions."""
    with scheduler_plugged(factory):
        llm = LLM(**llm_options)
    core = llm.engine.core
    counts: dict[str, int] = {}
    core.observers.append(invariant_checker(core, counts))
    _limit_steps(core.scheduler, max_steps=10 * len(prompts) * max_tokens + 1000)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [list(output.token_ids) for output in llm.generate(list(prompts), params)]
    assert core.block_manager.num_used_blocks == 0, "KV blocks are still held after every request finished"
    return tokens, core.scheduler.num_preemptions


def _limit_steps(scheduler: Any, max_steps: int) -> None:
    """Make ``scheduler.schedule`` raise ``AssertionError`` past ``max_steps`` calls: a scheduler that makes no
    progress (a request that never gets its blocks back, say) fails its test instead of running forever."""
    schedule, calls = scheduler.schedule, [0]

    def limited() -> Any:
        calls[0] += 1
        assert calls[0] <= max_steps, f"no end in sight after {max_steps} steps: is a request stuck?"
        return schedule()

    scheduler.schedule = limited


def p99_itl_s(result: SimResult, request_ids: Sequence[str] | None = None) -> float:
    """The 99th percentile of inter-token latency, seconds of virtual time, over the requests named (all)."""
    wanted = None if request_ids is None else set(request_ids)
    gaps = [gap for r in result.requests if wanted is None or r.request_id in wanted for gap in r.record.itl_s]
    return slo.percentile(gaps, 99)


def goodput_rps(result: SimResult, target: slo.SLO) -> float:
    """Requests per second of virtual time that met ``target``."""
    return slo.goodput_rps(result.records, target)


# --- chapter 07: a quantizer in every linear layer -------------------------------------------------------------

RoundTrip = Callable[[torch.Tensor], torch.Tensor]  # a float weight [out, in] → its dequantized float32 copy


def replace_linear_weights(llm: LLM, round_trip: RoundTrip) -> int:
    """Put ``round_trip(weight)`` in place of the weight of every ``nn.Linear`` of ``llm``'s decoder layers
    (attention and MLP projections); returns how many were replaced. The embedding, the norms and the output
    head stay float: the engine keeps its head at 8 bits under every scheme, and here it is tied to the
    embedding."""
    replaced = 0
    with torch.no_grad():
        for name, module in llm.engine.model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head":
                new = round_trip(module.weight.detach().clone()).to(module.weight.dtype)
                if new.shape != module.weight.shape:
                    raise ValueError(f"the round trip changed a weight's shape {tuple(module.weight.shape)}")
                module.weight.copy_(new)
                replaced += 1
    return replaced


def agreement_with_float(
    reference: LLM, candidate: LLM, num_tokens: int = 512, window_tokens: int = 256, offset_tokens: int = 0
) -> Agreement:
    """KL (nats per token) and top-1 agreement of ``candidate`` against ``reference`` on ``num_tokens`` tokens
    of the held-out text, from ``offset_tokens`` on, in windows of ``window_tokens``."""
    ids = reference.tokenizer.encode(held_out_text())[offset_tokens : offset_tokens + num_tokens]
    stream = torch.tensor(ids)
    return next_token_agreement(
        reference.engine.model.logits_without_cache, candidate.engine.model.logits_without_cache, stream, window_tokens
    )

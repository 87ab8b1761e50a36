"""Calibration: the step-cost model fitted to steps measured on the real engine.

:func:`measure_steps` plans a short, varied workload for an idle engine (single prompts, decode batches of
several sizes and contexts, and a mixed load), serves it with :func:`minserve.measure.arrivals.serve_arrivals`
and keeps every step's report (:class:`minserve.measure.steps.StepRecorder`): what the scheduler put in it
and how long it took; :func:`calibrate` fits :class:`~minserve.capacity.simulator.StepCostModel` to those
steps. ``minserve plan calibrate`` saves the result as JSON for ``minserve plan simulate``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from minserve.capacity.cost_model import DEFAULT_TERMS, StepCostModel, StepFeatures, StepSample
from minserve.capacity.simulator import SimRequest
from minserve.config import SchedulerConfig
from minserve.measure.arrivals import serve_arrivals
from minserve.measure.prompts import random_token_ids
from minserve.measure.steps import StepRecorder

if TYPE_CHECKING:
    from minserve.engine.engine import LLMEngine
    from minserve.engine.llm import LLM

# A rough fit in a few seconds (``minserve plan calibrate --quick``, and the tests): few prompts, short decodes.
QUICK_WORKLOAD: dict[str, Any] = dict(
    single_prompts=4,
    batch_sizes=(1, 8),
    context_lengths=(32, 128),
    decode_steps=8,
    mixed_requests=12,
    mixed_gaps_steps=(4.0,),
    max_output_tokens=32,
)


def measure_steps(
    llm: LLM | LLMEngine,
    single_prompts: int = 16,
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    context_lengths: Sequence[int] = (64, 512),
    decode_steps: int = 16,
    mixed_requests: int = 120,
    mixed_gaps_steps: Sequence[float] = (12.0, 4.0, 1.5),
    max_output_tokens: int = 128,
    seed: int = 0,
) -> list[StepSample]:
    """Run a short, varied workload on the engine and time every ``engine.step()`` with what it ran.

    Three parts, each piece ending with the engine idle:

    * ``single_prompts`` prompts of log-uniform lengths, one at a time, each decoded for ``decode_steps``
      tokens: prefill chunks alone, and decodes of one sequence;
    * for each batch size and context length, that many prompts prefilled together and then decoded
      together for ``decode_steps`` steps (each decodes long enough to outlast the staggered prefill);
    * ``mixed_requests`` requests of random lengths (outputs up to ``max_output_tokens``) arriving every few
      steps, at each mean gap of ``mixed_gaps_steps`` in turn (light to heavy load): prompt chunks beside
      decodes, as a real load runs.

    Decodes run long on purpose: the first few decode steps after a prefill are slower than the rest (on the
    CPU, up to twice the steady cost), so a workload of short outputs would overstate decode steps. Prompts
    are seeded random token ids, so the prefix cache never hits. Sizes are clipped to what the engine holds.
    Each step's composition and time come from the engine core's step report; the time is the whole step:
    scheduling, the forward pass, sampling and bookkeeping, which is what the next step waits for.
    """
    engine = getattr(llm, "engine", llm)
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; calibrate an idle engine, or the batches mix")
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    sizes = engine.scheduler_config
    max_seqs, capacity_tokens = sizes.max_num_seqs, sizes.kv_capacity_tokens
    longest = min(engine.max_model_len - 1, capacity_tokens) - 2  # the longest prompt + output of any request
    if longest < 4:
        raise ValueError("the engine's context or KV cache is too small to calibrate on")
    budget = sizes.max_num_batched_tokens

    def request(length: int, max_tokens: int) -> tuple[list[int], int]:
        length = int(min(max(length, 2), longest - 1))
        return random_token_ids(rng, length, vocab), int(max(1, min(max_tokens, longest - length)))

    plans: list[list[tuple[int, tuple[list[int], int]]]] = []
    top = math.log2(max(min(budget, longest), 4))
    for _ in range(single_prompts):
        plans.append([(0, request(round(2 ** rng.uniform(2, top)), decode_steps + 1))])
    for context in context_lengths:
        for batch in batch_sizes:
            context = min(context, longest - 1)
            stagger = -(-batch * context // budget) + 1  # steps before the last prompt of the batch is done
            max_tokens = min(stagger + decode_steps, longest - context)
            batch = min(batch, max_seqs, max(capacity_tokens // (context + max_tokens + 16), 1))
            plans.append([(0, request(context, max_tokens)) for _ in range(batch)])
    for gap in mixed_gaps_steps:
        plan, step_at = [], 0
        for _ in range(mixed_requests // max(len(mixed_gaps_steps), 1)):
            step_at += int(rng.exponential(gap))
            prompt_length = round(2 ** rng.uniform(3, min(9.5, top)))
            plan.append((step_at, request(prompt_length, int(rng.integers(1, max_output_tokens + 1)))))
        plans.append(plan)

    samples: list[StepSample] = []
    _run_plan(engine, [(0, request(64, 8)) for _ in range(4)], [])  # warm-up, not recorded
    for plan in plans:
        _run_plan(engine, plan, samples)
    return samples


def _run_plan(engine: LLMEngine, plan: list[tuple[int, tuple[list[int], int]]], samples: list[StepSample]) -> None:
    """Add each planned request at its step index and step until all are done, recording every step that ran
    something: what it scheduled and how long the whole step took (the core reports both)."""
    requests = [SimRequest(0.0, tuple(prompt), max_tokens) for _, (prompt, max_tokens) in plan]
    with StepRecorder(engine.core) as recorder:
        serve_arrivals(engine, requests, at_steps=[step for step, _ in plan])
    for report in recorder.reports:
        features = StepFeatures.of_scheduled(report.scheduled, report.num_swapped_blocks)
        samples.append(StepSample(features, report.step_s))


def calibrate(llm: LLM | LLMEngine, terms: Sequence[str] | None = None, **workload: Any) -> StepCostModel:
    """Measure steps on the engine (:func:`measure_steps`, ``workload`` its arguments) and fit a
    :class:`StepCostModel`. ``terms`` default to the backend's: padded decode reads for the torch reference,
    per-sequence reads for the Triton kernels. ``info`` records the engine (model, device, dtype, backend,
    threads and its :class:`SchedulerConfig`), so a cost file says what it is a model of.

    The defaults take about 10 s on a 2-core CPU with the embedded model (plus loading it).
    """
    import torch

    engine = getattr(llm, "engine", llm)
    start = time.perf_counter()
    samples = measure_steps(engine, **workload)
    backend = engine.model.backend.name
    if terms is None:
        terms = DEFAULT_TERMS.get(backend, DEFAULT_TERMS["triton"])
    info = {
        "model": engine.config.checkpoint.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "backend": backend,
        "threads": torch.get_num_threads() if engine.device.type == "cpu" else None,
        "engine": SchedulerConfig.from_engine(engine).to_dict(),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "measure_s": time.perf_counter() - start,
    }
    return StepCostModel.fit(samples, terms, info)

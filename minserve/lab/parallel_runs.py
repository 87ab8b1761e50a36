"""Chapter 06's runs on the engine: the same greedy requests in one process, split over two tensor-parallel
ranks, and cut into two pipeline stages; what each step scheduled, sent and took.

* :func:`run_engine_steps`: one engine's greedy run, one row per step (tokens, sampled rows, seconds) and,
  under tensor parallelism, what rank 0 put into each collective during that step (read from its
  :class:`~minserve.parallel.Traffic` after every step);
* :func:`bubble_sweep`: a pipeline fed steps of 1, 2, … sequences, each sequence one micro-batch, and the
  timelines of those steps, grouped by their number of micro-batches.

Every rank runs one torch thread (``ENGINE_OPTIONS``), so two ranks use the two cores of a small machine and
compare fairly with one process on one core. The predictions and checks these are held to are in
:mod:`minserve.lab.parallel_checks`; the figures in :mod:`minserve.lab.parallel_figures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from minserve.capacity.interconnect import Interconnect, ring_all_gather_s, ring_all_reduce_s
from minserve.capacity.parallel import pipeline_stages, stage_params_per_gpu
from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.step_report import StepReport
from minserve.measure.prompts import random_prompts
from minserve.measure.steps import StepRecorder, is_decode
from minserve.model.config import ModelConfig
from minserve.parallel.pipeline import PipelineStats, StepTimeline

# The CPU (the chapter's ranks talk over gloo, and a GPU machine may have one GPU where two ranks need two), and
# float32, so that split matmuls add up to one process's logits exactly enough for identical greedy tokens.
ENGINE_OPTIONS = {"device": "cpu", "dtype": "float32", "num_threads": 1, "enable_tracing": False}
WARM_UP = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
TRAFFIC_FIELDS = ("all_reduce_bytes", "all_reduce_calls", "all_gather_bytes", "all_gather_calls", "seconds")


@dataclass
class TrafficRun:
    """One engine's greedy run: the tokens of each request, and one row per step.

    ``steps`` columns: ``step`` (from 1), ``tokens`` (forwarded this step), ``rows`` (sequences that sampled a token),
    ``decode`` (every sequence decoding one token), ``executor_s`` (the forward pass and sampling, seconds)
    and, under tensor parallelism, rank 0's collectives during the step: ``all_reduce_bytes``,
    ``all_reduce_calls``, ``all_gather_bytes``, ``all_gather_calls`` and ``seconds`` spent in them.
    ``params_here``: parameters this process (rank 0) holds; ``kv_bytes_per_token``: its KV bytes a token.
    """

    token_ids: list[list[int]]
    steps: pd.DataFrame
    params_here: int
    kv_bytes_per_token: int


def run_engine_steps(llm: LLM, prompts: Sequence[str | list[int]], params: SamplingParams) -> TrafficRun:
    """Warm ``llm`` up, then generate ``prompts`` with one row per step (see :class:`TrafficRun`)."""
    llm.generate(prompts[:1], WARM_UP)  # first steps pay one-time costs (allocations, gloo's first buffers)
    comm = llm.engine.parallel.comm if llm.engine.parallel is not None else None

    def traffic(report: StepReport) -> dict[str, float]:  # after each step: the counters hold that step's too
        return {name: getattr(comm.traffic, name) for name in TRAFFIC_FIELDS} if comm else {}

    if comm is not None:
        comm.traffic.reset()
    with StepRecorder(llm.engine.core, traffic) as recorder:
        outputs = llm.generate(list(prompts), params)
    prompt_tokens = {o.request_id: len(o.prompt_token_ids) for o in outputs}
    rows, before = [], dict.fromkeys(TRAFFIC_FIELDS, 0) if comm else {}
    for number, (report, counted) in enumerate(zip(recorder.reports, recorder.probes), start=1):
        rows.append({
            "step": number,
            "tokens": report.num_tokens,
            "rows": sum(s.num_computed_tokens + s.num_new_tokens >= prompt_tokens[s.request_id]
                        for s in report.scheduled),
            "decode": is_decode(report),
            "executor_s": report.duration_s,
            **{name: counted[name] - before[name] for name in counted},
        })  # fmt: skip
        before = counted
    model = llm.engine.model
    return TrafficRun(
        token_ids=[o.token_ids for o in outputs],
        steps=pd.DataFrame(rows),
        params_here=sum(p.numel() for p in model.parameters()),
        kv_bytes_per_token=llm.engine.kv_bytes_per_token(),
    )


def latency_table(one: TrafficRun, split: TrafficRun, size: int, link: Interconnect) -> pd.DataFrame:
    """The median decode step (ms) of one process and of ``size`` tensor-parallel ranks, beside a prediction
    for the ranks: one process's step divided by ``size`` (each rank does ``1 / size`` of the work), plus
    the step's collectives on ``link`` (the ring model, :mod:`minserve.capacity.interconnect`), counted from
    the split run's own calls and bytes."""
    decode = split.steps[split.steps["decode"]]
    one_ms = 1e3 * float(one.steps.loc[one.steps["decode"], "executor_s"].median())
    reduce_calls = float(decode["all_reduce_calls"].median())
    reduce_each = float((decode["all_reduce_bytes"] / decode["all_reduce_calls"]).median())
    gather_each = float((decode["all_gather_bytes"] / decode["all_gather_calls"]).median())
    gather_calls = float(decode["all_gather_calls"].median())
    collectives_ms = 1e3 * (reduce_calls * ring_all_reduce_s(reduce_each, size, link)
                            + gather_calls * ring_all_gather_s(gather_each, size, link))  # fmt: skip
    rows = [
        {"run": "one process", "step ms (measured)": one_ms, "in collectives ms (measured)": 0.0,
         "step ms (predicted)": one_ms, "collectives ms (predicted)": 0.0},
        {"run": f"TP={size}", "step ms (measured)": 1e3 * float(decode["executor_s"].median()),
         "in collectives ms (measured)": 1e3 * float(decode["seconds"].median()),
         "step ms (predicted)": one_ms / size + collectives_ms, "collectives ms (predicted)": collectives_ms},
    ]  # fmt: skip
    return pd.DataFrame(rows).set_index("run")


# --- the pipeline's bubble ------------------------------------------------------------------------------------


def bubble_sweep(
    llm: LLM, micro_batches: Sequence[int] = (1, 2, 4), prompt_tokens: int = 256, rounds: int = 4, seed: int = 0
) -> dict[int, PipelineStats]:
    """The pipeline's timelines of prefill steps of ``m`` sequences for each ``m`` in ``micro_batches``.

    The engine splits a step into at most its ``num_micro_batches`` micro-batches of whole sequences, so a
    step of ``m`` equal prompts (``prompt_tokens`` random ids each, ``max_tokens=1``: the step is the prefill)
    is ``m`` equal micro-batches, which is what the formula assumes. Each ``m`` runs ``rounds`` steps.
    """
    most = llm.engine.config.parallel.num_micro_batches or llm.engine.config.parallel.pipeline_parallel_size
    if max(micro_batches) > most:
        raise ValueError(f"micro-batch counts {list(micro_batches)} exceed the engine's num_micro_batches={most}")
    vocab = llm.model_config.vocab_size
    prompts = random_prompts([prompt_tokens] * (sum(micro_batches) * rounds), vocab, seed)
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], one_token)  # warm-up
    llm.engine.pipeline_stats(reset=True)
    stats = {}
    for m in micro_batches:
        for _ in range(rounds):
            batch, prompts = prompts[:m], prompts[m:]
            llm.generate(batch, one_token)
        stats[m] = llm.engine.pipeline_stats(reset=True)
    return stats


def concurrent_s(step: StepTimeline) -> float:
    """Seconds of the step during which at least two stages were working at once (0 without overlap)."""
    events = sorted((t, delta) for stage in step.spans for start, end in stage for t, delta in ((start, 1), (end, -1)))
    busy, since, total = 0, 0.0, 0.0
    for t, delta in events:
        if busy >= 2:
            total += t - since
        busy, since = busy + delta, t
    return total


def bubble_table(stats: dict[int, PipelineStats]) -> pd.DataFrame:
    """Per micro-batch count: steps, the bubble predicted and measured, the mean step (ms), each stage's work
    in a step (ms) and the share of the step's span during which two stages worked at once."""
    rows = []
    for m, run in stats.items():
        span_s = sum(step.span_s for step in run.steps)
        stages = run.steps[0].num_stages
        rows.append({
            "micro-batches": m,
            "steps": len(run.steps),
            "bubble (predicted)": run.predicted_bubble_fraction,
            "bubble (measured)": run.bubble_fraction,
            "step ms": 1e3 * span_s / len(run.steps),
            **{f"stage {s} ms": 1e3 * sum(e - b for step in run.steps for b, e in step.spans[s]) / len(run.steps)
               for s in range(stages)},
            "overlap share": sum(concurrent_s(step) for step in run.steps) / span_s,
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("micro-batches")


def rank_memory_table(
    runs: dict[str, tuple[TrafficRun, int, int]], one: TrafficRun, config: ModelConfig
) -> pd.DataFrame:
    """What this process (rank 0) holds in each run (name → (run, tensor-parallel size, pipeline-parallel
    size)), beside one process: parameters, measured and as the planner counts the first stage's share
    (:func:`minserve.capacity.parallel.stage_params_per_gpu`), and KV bytes a token."""
    layouts = {"one process": (one, 1, 1), **runs}
    rows = {}
    for name, (run, tp, pp) in layouts.items():
        stage = pipeline_stages(config, pp)[0]
        rows[name] = {
            "parameters (measured)": run.params_here,
            "parameters (planner)": stage_params_per_gpu(config, stage, tp),
            "share of the model": run.params_here / one.params_here,
            "KV bytes/token": run.kv_bytes_per_token,
        }
    return pd.DataFrame.from_dict(rows, orient="index")

"""Pipeline parallelism's bubble, measured on two stages beside the formula (p − 1) / (m + p − 1).

    python benchmarks/pipeline.py                                  # minserve-tiny, m = 1, 2, 4
    python benchmarks/pipeline.py --model smollm2-135m-instruct    # 30 layers: 15 a stage
    python benchmarks/pipeline.py --micro-batches 1 2 4 8 --json results.json

One process first (one torch thread), then ``pipeline_parallel_size=2`` with each micro-batch count in turn,
every rank on one torch thread, so that on two cores the two stages really run side by side. Each run
generates greedily for ``--prompts`` random prompts of ``--prompt-tokens`` tokens (no shared prefixes),
``--tokens`` tokens each (``ignore_eos``), after a short warm-up whose steps are forgotten. Every pipelined
run is checked to give the one process's tokens.

Reported per run: the steps, the bubble measured over all of them (the stages' idle seconds inside each
step's span over p × the span, :class:`minserve.parallel.pipeline.PipelineStats`), the formula for ``m``,
the bubble of the prefill steps and of the decode steps apart, the mean step (the span from stage 0's first
micro-batch to the last stage's last), each stage's work in a step (stage 0 / stage 1, milliseconds), and
output tokens per second. The formula assumes equal stages and
free communication; what it leaves out (the head on the last stage, hidden states crossing over gloo, the
broadcast of each step) is in the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from minserve import LLM, SamplingParams
from minserve.measure.prompts import random_prompts
from minserve.parallel.pipeline import PipelineStats, predicted_bubble_fraction

NUM_STAGES = 2
COLUMNS = ("run", "m", "steps", "bubble", "formula", "bubble_prefill", "bubble_decode", "step_ms", "stage_ms",
           "tok_s")  # fmt: skip


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float, list[bool]]:
    """Warm up, then generate ``batch``: its tokens, the seconds it took, and per step whether it prefilled."""
    llm.generate(batch[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    prefilled: list[bool] = []
    llm.engine.core.observers.append(lambda report: prefilled.append(report.num_tokens > len(report.scheduled)))
    if llm.engine.config.parallel.pipeline_parallel_size > 1:
        llm.engine.pipeline_stats(reset=True)
    start_s = time.perf_counter()
    outputs = llm.generate(batch, params)
    return [o.token_ids for o in outputs], time.perf_counter() - start_s, prefilled


def measure(model: str, micro_batches: list[int], num_prompts: int, prompt_tokens: int, num_tokens: int) -> list:
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    options = {"dtype": "float32", "num_threads": 1, "enable_tracing": False}
    one = LLM(model, **options)
    batch = random_prompts([prompt_tokens] * num_prompts, one.model_config.vocab_size)
    expected, seconds, prefilled = run(one, batch, params)
    rows = [{"run": "one process", "m": "", "steps": len(prefilled), "bubble": "", "formula": "",
             "bubble_prefill": "", "bubble_decode": "", "step_ms": "", "stage_ms": "",
             "tok_s": round(num_prompts * num_tokens / seconds, 1)}]  # fmt: skip
    print(_markdown_row(rows[-1]), flush=True)
    del one
    for m in micro_batches:
        llm = LLM(model, pipeline_parallel_size=NUM_STAGES, num_micro_batches=m, **options)
        try:
            tokens, seconds, prefilled = run(llm, batch, params)
            stats = llm.engine.pipeline_stats()
        finally:
            llm.engine.shutdown()
        assert tokens == expected, f"m={m}: the pipeline changed the greedy output"
        assert len(stats.steps) == len(prefilled)
        prefill = PipelineStats([s for s, p in zip(stats.steps, prefilled) if p])
        decode = PipelineStats([s for s, p in zip(stats.steps, prefilled) if not p])
        rows.append({"run": f"{NUM_STAGES} stages", "m": m, "steps": len(stats.steps),
                     "bubble": round(stats.bubble_fraction, 3),
                     "formula": round(predicted_bubble_fraction(NUM_STAGES, m), 3),
                     "bubble_prefill": round(prefill.bubble_fraction, 3),
                     "bubble_decode": round(decode.bubble_fraction, 3),
                     "step_ms": round(1e3 * sum(s.span_s for s in stats.steps) / len(stats.steps), 2),
                     "stage_ms": " / ".join(f"{ms:.2f}" for ms in _busy_ms_per_stage(stats)),
                     "tok_s": round(num_prompts * num_tokens / seconds, 1)})  # fmt: skip
        print(_markdown_row(rows[-1]), flush=True)
    return rows


def _busy_ms_per_stage(stats: PipelineStats) -> list[float]:
    """Each stage's work in a step, on average (milliseconds): unequal stages widen the bubble."""
    steps = stats.steps
    return [1e3 * sum(end - start for step in steps for start, end in step.spans[s]) / len(steps)
            for s in range(NUM_STAGES)]  # fmt: skip


def _markdown_row(row: dict) -> str:
    return "| " + " | ".join(str(row[c]) for c in COLUMNS) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=16, help="requests, all in one batch")
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # other processes on the cores slow whichever stage they land on
    print(f"{args.model}, {args.prompts} prompts of {args.prompt_tokens} tokens, {args.tokens} tokens each, "
          f"one torch thread a rank, {os.cpu_count()} cores ({platform.machine()}), load {load:.1f}")  # fmt: skip
    print("| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS))
    rows = measure(args.model, args.micro_batches, args.prompts, args.prompt_tokens, args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            setting = {"model": args.model, "stages": NUM_STAGES, "prompts": args.prompts,
                       "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "cores": os.cpu_count(),
                       "load_average_before": load, "load_average_after": os.getloadavg()[0]}  # fmt: skip
            json.dump({**setting, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Latency levers, one at a time, after a profile: each against the same engine without it, in one process.

    python benchmarks/levers.py                           # minserve-tiny (~45 s on 2 CPU cores, 20 s compiling)
    python benchmarks/levers.py --model smollm2-135m-instruct --tokens 32        # SmolLM2 (~5 minutes)
    python benchmarks/levers.py --json benchmarks/results/levers-cpu-2026-12-04.json

**Profile first.** Two workloads, each request sent alone with the prefix cache off, as chapter 08 does:
``chat`` (the ``grounded`` prompts of :func:`minserve.capacity.speculation_runs.workloads`, ``--tokens``
tokens of answer) and ``system prompt`` (a 512-token shared prefix, 16 tokens of each request's own, an
8-token answer). Each request's latency splits into prefill (its TTFT) and decode (the rest), from the
engine's own :class:`~minserve.engine.outputs.RequestMetrics`; the dominant phase is named.

**Then each lever alone**, as a :class:`minserve.capacity.levers.Lever` row (a quantity where lower is
better, without and with the lever, ratio = without / with, so above 1 the lever helped):

* prefix reuse, on the system-prompt workload: mean TTFT (:func:`minserve.capacity.levers.prefix_reuse`),
  and the prompt tokens the engine's steps computed over the run;
* ``torch.compile`` of decode steps (``compile_model=True``, both sides on the torch backend): the
  engine's start-up seconds (the compile, in a fresh inductor cache, so a first-time user's, and the
  decode steps that repay it), then steady-state decode, the mean TPOT (ms per output token of a request:
  one decode step) at batch 1 and at batch ``--batch``;
* speculative decoding (prompt lookup, k = 3) at batch 1 on the grounded workload
  (:func:`minserve.capacity.speculation_runs.compare`): ms per output token;
* the Triton kernels (against the torch backend) and CUDA graphs (against the Triton backend without
  them): TPOT at batch 1 and ``--batch``, only where ``torch.cuda.is_available()``; elsewhere a row says
  it needs a GPU.

Greedy, ``ignore_eos``; every timed comparison runs ``--repeats`` rounds, the two engines alternating, and
keeps each side's median. Every lever's greedy tokens are asserted equal to the plain engine's, so a speedup
never comes from different output. ``--dtype`` is float32 by default: on a GPU, bfloat16's rounding lets
two correct backends disagree on a near tie, which the assertion would take for a bug.
``--json`` writes the profile and the rows, which chapter 08's levers table reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from minserve import LLM, RequestOutput, SamplingParams
from minserve.capacity import levers
from minserve.capacity.levers import Lever
from minserve.capacity.speculation_runs import compare, greedy, spec_config, timed_run, workloads
from minserve.engine.step_report import StepReport

Prompt = str | list[int]
SYSTEM_PROMPT_TOKENS, OWN_TOKENS, SYSTEM_ANSWER_TOKENS = 512, 16, 8  # chapter 08's system-prompt workload
BATCH_1_REQUESTS = 8  # requests sent one at a time in every batch-1 measurement


def profile(engine: Callable[..., LLM], tokens: int) -> list[dict[str, Any]]:
    """Per workload: mean prefill ms (TTFT) and decode ms (the rest), the prefill share, the dominant phase.
    The prefix cache is off: the profile measures the work, not a cache's shortcut."""
    llm = engine(enable_prefix_caching=False)
    llm.generate(["warm-up"], greedy(4))
    runs = {
        "chat": levers.one_at_a_time(llm, workloads(BATCH_1_REQUESTS)["grounded"], greedy(tokens)),
        "system prompt": levers.one_at_a_time(llm, system_prompts(llm), greedy(SYSTEM_ANSWER_TOKENS)),
    }
    rows = []
    for workload, outputs in runs.items():
        split = levers.phase_split(outputs)
        rows.append({
            "workload": workload, "requests": split.requests, "prefill_ms": round(split.prefill_s * 1e3, 2),
            "decode_ms": round(split.decode_s * 1e3, 2), "prefill_share": round(split.prefill_share, 3),
            "dominant": split.dominant,
        })  # fmt: skip
    return rows


def system_prompts(llm: LLM) -> list[list[int]]:
    """One shared 512-token prefix, then 16 tokens of each request's own: nine requests."""
    vocab = llm.model_config.vocab_size
    return levers.shared_prefix_prompts(BATCH_1_REQUESTS + 1, SYSTEM_PROMPT_TOKENS, OWN_TOKENS, vocab)


# --- one lever at a time ------------------------------------------------------------------------------------


def generate_in_batches(llm: LLM, prompts: Sequence[Prompt], params: SamplingParams, batch: int) -> list[RequestOutput]:
    """``batch`` prompts per ``generate``, one ``generate`` after another."""
    return [out for i in range(0, len(prompts), batch) for out in llm.generate(prompts[i : i + batch], params)]


def mean_tpot_s(outputs: Sequence[RequestOutput]) -> float:
    """Mean time per output token after the first, in seconds: one decode step, as each request saw it."""
    return statistics.fmean(o.metrics.tpot_s or 0.0 for o in outputs)


def decode_lever(name: str, without: LLM, with_lever: LLM, batch: int, tokens: int, repeats: int) -> Lever:
    """Mean TPOT at ``batch`` (batch 1: eight requests one at a time), the two engines alternating for
    ``repeats`` rounds after a warm-up each; the median of each side's rounds."""
    prompts = workloads(max(batch, BATCH_1_REQUESTS))["open"]
    tpot_s: dict[str, list[float]] = {"without": [], "with": []}
    tokens_of: dict[str, list[list[int]]] = {}
    for llm in (without, with_lever):
        generate_in_batches(llm, prompts[:batch], greedy(4), batch)
    for _ in range(repeats):
        for side, llm in (("without", without), ("with", with_lever)):
            outputs = generate_in_batches(llm, prompts, greedy(tokens), batch)
            tpot_s[side].append(mean_tpot_s(outputs))
            tokens_of[side] = [o.token_ids for o in outputs]
    without_ms, with_ms = (statistics.median(tpot_s[side]) * 1e3 for side in ("without", "with"))
    return Lever(
        lever=f"{name} (batch {batch})",
        phase="decode",
        quantity=f"TPOT (ms), batch {batch}",
        without=round(without_ms, 3),
        with_lever=round(with_ms, 3),
        same_output=tokens_of["with"] == tokens_of["without"],
        note=f"decode {batch / without_ms * 1e3:.0f} → {batch / with_ms * 1e3:.0f} tokens/s",
    )


def timed_start_up(engine: Callable[..., LLM], **options: Any) -> tuple[LLM, float]:
    """A new engine and the seconds it took to build (loading, KV allocation, any compiling)."""
    start_s = time.perf_counter()
    llm = engine(**options)
    return llm, time.perf_counter() - start_s


@contextlib.contextmanager
def fresh_inductor_cache() -> Iterator[None]:
    """Inductor's on-disk cache in a new, empty directory for the duration (then the previous setting)."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="levers-inductor-") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        try:
            yield
        finally:
            if previous is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def compile_levers(engine: Callable[..., LLM], batch: int, tokens: int, repeats: int) -> list[Lever | dict[str, Any]]:
    """torch.compile of decode steps against the same engine without it, both on the torch backend (the one
    that compiles): what start-up costs, then decode at batch 1 and at ``batch``.

    The compile runs in a fresh inductor cache, as a first-time user's does: a warm cache skips inductor's
    code generation and the C++ compiler, most of the compile."""
    plain, plain_start_s = timed_start_up(engine, backend="torch")
    with fresh_inductor_cache():
        try:
            compiled, compiled_start_s = timed_start_up(engine, backend="torch", compile_model=True)
        except ValueError as error:  # it cannot compile here: the row says why, the other levers go on
            return [not_measured("torch.compile", "decode", str(error))]
        decode = [decode_lever("torch.compile", plain, compiled, b, tokens, repeats) for b in (1, batch)]
    compile_s = compiled.engine.runner.compiled.compile_s
    saved_s = (decode[0].without - decode[0].with_lever) / 1e3  # per decode step at batch 1
    payback = f"; repaid after {compile_s / saved_s:,.0f} decode steps at batch 1" if saved_s > 0 else ""
    start_up = Lever(
        lever="torch.compile (start-up)",
        phase="start-up",
        quantity="engine start-up (s)",
        without=round(plain_start_s, 3),
        with_lever=round(compiled_start_s, 3),
        same_output=True,  # nothing generated at start-up; the decode rows compare tokens
        note=f"{compile_s:.1f} s of it compiling, once, before any request{payback}",
    )
    return [start_up, *decode]


def prefix_levers(engine: Callable[..., LLM], prompts: list[list[int]]) -> list[Lever]:
    """Prefix reuse on the system-prompt workload: mean TTFT (:func:`minserve.capacity.levers.prefix_reuse`),
    and the prompt tokens each engine's steps ran through the model over the whole run, the first request
    (which fills the cache) included."""
    with_cache, without_cache = engine(enable_prefix_caching=True), engine(enable_prefix_caching=False)
    computed = {"with": PromptTokensComputed(with_cache), "without": PromptTokensComputed(without_cache)}
    ttft = levers.prefix_reuse(with_cache, without_cache, prompts, SYSTEM_ANSWER_TOKENS)
    work = Lever(
        lever="prefix reuse (prefill work)",
        phase="prefill",
        quantity=f"prompt tokens computed, {len(prompts)} requests",
        without=computed["without"].tokens,
        with_lever=computed["with"].tokens,
        same_output=ttft.same_output,
    )
    return [ttft, work]


class PromptTokensComputed:
    """Counts the prompt tokens an engine's steps run through the model (whole prompts and chunks of them)."""

    def __init__(self, llm: LLM) -> None:
        self.tokens = 0
        llm.engine.core.observers.append(self)

    def __call__(self, report: StepReport) -> None:
        self.tokens += sum(seq.num_new_tokens for seq in report.scheduled if seq.state == "prefill")


def speculation_lever(engine: Callable[..., LLM], plain: LLM, tokens: int) -> Lever:
    """Prompt lookup with k = 3 at batch 1 on the grounded workload, as ``benchmarks/speculative.py`` runs it."""
    prompts, params = workloads(BATCH_1_REQUESTS)["grounded"], greedy(tokens)
    reference = timed_run(plain, prompts, params, batch=1)
    speculative = engine(speculative_config=spec_config("ngram", 3))
    point = compare(reference, speculative, prompts, params, 1, workload="grounded", proposer="ngram")
    return Lever(
        lever="speculative decoding (n-gram, k = 3)",
        phase="decode",
        quantity="ms per output token, batch 1",
        without=round(1e3 / point.plain_tok_s, 3),
        with_lever=round(1e3 / point.spec_tok_s, 3),
        same_output=point.same_output,
        note=f"α = {point.acceptance:.2f}",
    )


def gpu_levers(engine: Callable[..., LLM], batch: int, tokens: int, repeats: int) -> list[Lever | dict[str, Any]]:
    """The Triton kernels against the torch backend (no CUDA graphs on either side), then CUDA graphs
    against the Triton backend without them: on a CUDA GPU, or a row each saying it needs one."""
    if not torch.cuda.is_available():
        return [not_measured("Triton kernels", "decode"), not_measured("CUDA graphs", "decode")]
    torch_eager = engine(backend="torch", enable_cuda_graphs=False)
    triton_eager = engine(backend="triton", enable_cuda_graphs=False)
    triton_graphs = engine(backend="triton", enable_cuda_graphs=True)
    rows = [decode_lever("Triton kernels", torch_eager, triton_eager, b, tokens, repeats) for b in (1, batch)]
    return rows + [decode_lever("CUDA graphs", triton_eager, triton_graphs, b, tokens, repeats) for b in (1, batch)]


def not_measured(lever: str, phase: str, why: str = "needs a GPU (not measured here)") -> dict[str, Any]:
    """A row for a lever this machine cannot pull: the table shows it, and why, with no numbers."""
    return {"lever": lever, "phase": phase, "quantity": "", "without": None, "with_lever": None,
            "same_output": None, "note": why, "ratio": None}  # fmt: skip


# --- the report ---------------------------------------------------------------------------------------------

PROFILE_COLUMNS = ("workload", "requests", "prefill_ms", "decode_ms", "prefill_share", "dominant")
LEVER_COLUMNS = ("lever", "phase", "quantity", "without", "with_lever", "ratio", "same_output", "note")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def as_row(lever: Lever | dict[str, Any]) -> dict[str, Any]:
    return lever.row() if isinstance(lever, Lever) else lever


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--dtype", default="float32", help="weights and KV (see the module docstring)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request (chat, decode levers)")
    parser.add_argument("--batch", type=int, default=32, help="the larger batch of the decode levers")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each timed comparison")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", help="write the profile and the rows here")
    args = parser.parse_args()

    def engine(**options: Any) -> LLM:
        return LLM(args.model, dtype=args.dtype, num_threads=args.threads, enable_tracing=False, **options)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"{args.model}, {args.dtype}, {args.tokens} tokens per request, {args.threads} thread(s), {device}\n")
    phases = profile(engine, args.tokens)
    print("Profile (each request alone, prefix cache off):\n\n" + markdown_table(phases, PROFILE_COLUMNS) + "\n")
    for row in phases:
        print(f"{row['workload']}: {row['dominant']} dominates ({row['prefill_share']:.0%} of latency in prefill)")

    plain = engine()
    rows: list[Lever | dict[str, Any]] = [
        *prefix_levers(engine, system_prompts(plain)),
        *compile_levers(engine, args.batch, args.tokens, args.repeats),
        speculation_lever(engine, plain, args.tokens),
        *gpu_levers(engine, args.batch, args.tokens, args.repeats),
    ]
    table = [as_row(row) for row in rows]
    print("\nEach lever alone (ratio = without / with: above 1, the lever helped):\n")
    print(markdown_table(table, LEVER_COLUMNS))
    different = [row["lever"] for row in table if row["same_output"] is False]
    assert not different, f"these levers changed the greedy output: {different}"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "tokens": args.tokens, "batch": args.batch,
                       "repeats": args.repeats, "threads": args.threads, "device": device, "profile": phases,
                       "rows": table}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

"""Offline throughput: minserve against transformers' ``generate`` on the same checkpoint and workload.

    python benchmarks/offline.py                     # 64 requests on minserve-tiny, 3 rounds (~3 minutes)
    python benchmarks/offline.py --requests 16       # quicker
    python benchmarks/offline.py --json results.json

nano-vllm's shape of workload, scaled for a CPU: N requests with random prompt lengths and random output
lengths, ``ignore_eos`` so each makes exactly the tokens asked for. Three sides run one after another, each
in its own process so its peak resident memory is its own:

* ``minserve``: all requests to ``LLM.generate`` at once (continuous batching, paged KV cache);
* ``transformers``: ``model.generate`` over batches of ``--hf-batch`` prompts, left-padded, greedy, with
  ``max_new_tokens`` the longest output in the batch: what a user of transformers would write. Only the
  tokens each request asked for count as output;
* ``minserve-serial``: minserve one request at a time (``max_num_seqs=1``), to show what batching buys.

Output tokens/s and the ratios are printed, with where minserve's time goes: the model forward and its
logits against everything else in a step (sampling, scheduling, block management, building tensors,
detokenizing).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SIDES = ("minserve", "transformers", "minserve-serial")


def workload(num_requests: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, drawn from a fixed seed."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 2048) for _ in range(rng.randint(16, max_prompt))], rng.randint(16, max_output))
        for _ in range(num_requests)
    ]


def run_minserve(model: str, requests, serial: bool, **llm_options) -> dict:
    from minserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=1 if serial else 64, enable_tracing=False, **llm_options)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    # The forward pass and the logits, timed from the model runner: a timer inside the model's forward
    # would be inside what compile_model=True compiled, and change it (minserve.engine.compilation).
    forward_s = _time_calls(llm.engine.runner, "logits")
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    wall_s = time.perf_counter() - start
    failed = [o.error for o in outputs if o.finish_reason == "error"]
    if failed:  # a failed request makes fewer tokens, which would read as a slow engine
        raise SystemExit(f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0]}")
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"wall_s": wall_s, "output_tokens": tokens, "forward_s": forward_s[0], "steps": forward_s[1]}


def _time_calls(obj, name: str) -> list[float]:
    """Wrap ``obj.name`` to accumulate [seconds inside it, number of calls] (this script only)."""
    totals = [0.0, 0]
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - start
            totals[1] += 1

    setattr(obj, name, timed)
    return totals


def load_transformers(model: str, dtype: torch.dtype = torch.float32):
    """The checkpoint as a transformers model: a directory, or a GGUF file (dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    from minserve.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_file():  # a .gguf file: transformers reads it from its folder
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_transformers(model: str, requests, batch_size: int, dtype: torch.dtype = torch.float32) -> dict:
    hf = load_transformers(model, dtype)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    with torch.inference_mode():
        hf.generate(torch.tensor([requests[0][0]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            longest = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
            max_new = max(n for _, n in batch)
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
            tokens += sum(n for _, n in batch)  # only what each request asked for is useful output
        wall_s = time.perf_counter() - start
    return {"wall_s": wall_s, "output_tokens": tokens}


def run_side(args) -> dict:
    torch.manual_seed(0)
    requests = workload(args.requests, args.seed, args.max_prompt, args.max_output)
    if args.side == "transformers":
        result = run_transformers(args.model, requests, args.hf_batch)
    else:
        result = run_minserve(args.model, requests, serial=args.side == "minserve-serial")
    result["tokens_per_s"] = result["output_tokens"] / result["wall_s"]
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident set size. ``ru_maxrss`` is in bytes on macOS and in KiB on Linux."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def median_round(runs: list[dict]) -> dict:
    """The round with the median throughput, plus every round's throughput (``tokens_per_s_rounds``)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ordered[len(ordered) // 2] | {"tokens_per_s_rounds": [r["tokens_per_s"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256, help="prompt lengths are uniform in [16, this]")
    parser.add_argument("--max-output", type=int, default=128, help="output lengths are uniform in [16, this]")
    parser.add_argument("--hf-batch", type=int, default=16, help="transformers' batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all three sides, interleaved")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args)))
        return 0

    forwarded = [
        f"--model={args.model}",
        f"--requests={args.requests}",
        f"--max-prompt={args.max_prompt}",
        f"--max-output={args.max_output}",
        f"--hf-batch={args.hf_batch}",
        f"--seed={args.seed}",
    ]
    # Rounds of all three sides, one after another: background load that comes and goes then touches every
    # side alike, and the median of each side's rounds (with its spread) is what gets reported.
    rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:
            command = [sys.executable, __file__, *forwarded, "--side", side]
            out = subprocess.run(command, capture_output=True, text=True)
            if out.returncode:
                sys.stderr.write(out.stderr)
                return out.returncode
            rounds[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {side: median_round(runs) for side, runs in rounds.items()}
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


def print_table(results: dict, args) -> None:
    base = results["transformers"]["tokens_per_s"]
    shape = f"{args.requests} requests, prompts 16–{args.max_prompt}, outputs 16–{args.max_output} tokens"
    print(
        f"\n{shape}, {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}\n"
    )
    print(f"median of {args.repeats} interleaved rounds (each round's tok/s in brackets)\n")
    print(f"{'side':<18}{'output tok/s':>14}{'vs transformers':>17}{'wall s':>9}{'peak RSS MB':>13}   rounds")
    for side, r in results.items():
        rounds = ", ".join(f"{t:,.0f}" for t in r["tokens_per_s_rounds"])
        print(f"{side:<18}{r['tokens_per_s']:>14,.0f}{r['tokens_per_s'] / base:>16.2f}×{r['wall_s']:>9.1f}"
              f"{r['peak_rss_bytes'] / 2**20:>13,.0f}   [{rounds}]")  # fmt: skip
    m = results["minserve"]
    per_step_ms = 1e3 * m["wall_s"] / m["steps"]
    forward_ms = 1e3 * m["forward_s"] / m["steps"]
    print(f"\nminserve: {m['steps']} steps, {per_step_ms:.2f} ms per step: {forward_ms:.2f} ms model forward and "
          f"logits ({m['forward_s'] / m['wall_s']:.0%}), {per_step_ms - forward_ms:.2f} ms the rest (sampling, "
          "scheduling, blocks, tensors, detokenizing)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

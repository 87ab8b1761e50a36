"""Server overhead: the same workload through ``minserve serve`` over HTTP, and through ``LLM.generate``.

    python benchmarks/server_vs_offline.py                  # 64 requests on minserve-tiny (~1 minute)
    python benchmarks/server_vs_offline.py --json out.json

The workload is ``benchmarks/offline.py``'s (random prompt token ids, random output lengths, ``ignore_eos``),
sent two ways, one after the other:

* ``offline``: every request to ``LLM.generate`` at once, in a process of its own;
* ``server``: ``minserve serve`` in a process of its own, with the same engine settings, and
  ``minserve bench``'s client in this process sending every request at once (rate = inf), streaming, with
  the prompts as token ids, so the engine sees exactly the offline side's work.

What the ratio measures is everything HTTP adds: parsing and checking each request, the hop between the
event loop and the engine thread, one server-sent event per token, and the client itself, which shares this
machine's cores with the server (its CPU time is printed beside the ratio).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import workload

MAX_NUM_SEQS = 64


def run_offline(model: str, requests) -> dict:
    """All requests through ``LLM.generate`` at once: output tokens and wall seconds."""
    import time

    from minserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=MAX_NUM_SEQS)
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    wall_s = time.perf_counter() - start
    return {"output_tokens": sum(len(o.token_ids) for o in outputs), "wall_s": wall_s}


def run_server(model: str, requests) -> dict:
    """All requests at once through HTTP, streamed, against a server in its own process."""
    from minserve.bench.arrivals import OpenLoop
    from minserve.bench.benchmark import run_benchmark
    from minserve.bench.client import ClientConfig
    from minserve.bench.workload import BenchRequest
    from minserve.serve.launch import ServerProcess

    sends = [BenchRequest(i, prompt, n) for i, (prompt, n) in enumerate(requests)]
    with ServerProcess(["--max-num-seqs", str(MAX_NUM_SEQS)], model=model) as server:
        client = ClientConfig(server.url, model, ignore_eos=True)
        run_benchmark(client, sends[:1], [OpenLoop(float("inf"))], progress=False)  # warm-up, like offline's
        result = run_benchmark(client, sends, [OpenLoop(float("inf"))], progress=False)
    summary, run = result.summaries[0], result.runs[0]
    if summary["ok"] != len(requests):
        raise RuntimeError(f"the server did not answer every request: {summary['errors']}")
    return {
        "output_tokens": summary["total_output_tokens"],
        "wall_s": run.duration_s,
        "client_cpu_s": run.client_cpu_s,
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256, help="prompt lengths are uniform in [16, this]")
    parser.add_argument("--max-output", type=int, default=128, help="output lengths are uniform in [16, this]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=["offline"], help=argparse.SUPPRESS)  # internal: the offline process
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    requests = workload(args.requests, args.seed, args.max_prompt, args.max_output)
    if args.side == "offline":
        print(json.dumps(run_offline(args.model, requests)))
        return 0

    forwarded = [f"--model={args.model}", f"--requests={args.requests}", f"--max-prompt={args.max_prompt}",
                 f"--max-output={args.max_output}", f"--seed={args.seed}"]  # fmt: skip
    offline = subprocess.run(
        [sys.executable, __file__, *forwarded, "--side", "offline"], capture_output=True, text=True
    )
    if offline.returncode:
        sys.stderr.write(offline.stderr)
        return offline.returncode
    results = {
        "offline": json.loads(offline.stdout.strip().splitlines()[-1]),
        "server": run_server(args.model, requests),
    }
    for side in results.values():
        side["tokens_per_s"] = side["output_tokens"] / side["wall_s"]
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


def print_table(results: dict, args) -> None:
    offline, server = results["offline"], results["server"]
    shape = f"{args.requests} requests, prompts 16–{args.max_prompt}, outputs 16–{args.max_output} tokens"
    print(f"\n{shape}, {args.model}, torch {torch.__version__}, {platform.machine()}\n")
    print(f"{'side':<36}{'output tok/s':>14}{'vs offline':>12}{'wall s':>9}")
    for name, r in (("offline (LLM.generate)", offline), ("server (HTTP, streamed, rate=inf)", server)):
        print(f"{name:<36}{r['tokens_per_s']:>14,.0f}{r['tokens_per_s'] / offline['tokens_per_s']:>11.2f}×"
              f"{r['wall_s']:>9.1f}")  # fmt: skip
    print(f"\nthe client's own CPU time: {server['client_cpu_s']:.1f} s "
          f"({server['client_cpu_s'] / server['wall_s']:.0%} of one core during the run)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

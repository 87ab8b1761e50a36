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
front end and the engine core process, one server-sent event per token, and the client itself, which shares
this machine's cores with the server (the CPU time of each part is printed).

Two pairs run. With each side's defaults, the offline engine uses every core, and so does ``minserve
serve``'s engine on a CPU of two or three cores (from four up it keeps one for HTTP); the load tester shares
the machine too, so on few cores that contention, not HTTP, is most of any gap. The controlled pair runs both engines
on ``--engine-threads`` threads (default 1), so the HTTP side has a core of its own on both: that ratio is
what HTTP itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import workload

MAX_NUM_SEQS = 64


def run_offline(model: str, requests, threads: int | None) -> dict:
    """All requests through ``LLM.generate`` at once: output tokens and wall seconds."""
    import time

    from minserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=MAX_NUM_SEQS, num_threads=threads)
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    wall_s = time.perf_counter() - start
    return {"output_tokens": sum(len(o.token_ids) for o in outputs), "wall_s": wall_s}


def run_server(model: str, requests, threads: int | None) -> dict:
    """All requests at once through HTTP, streamed, against a server in its own process."""
    from minserve.bench.arrivals import OpenLoop
    from minserve.bench.benchmark import run_benchmark
    from minserve.bench.client import ClientConfig
    from minserve.bench.workload import BenchRequest
    from minserve.serve.launch import ServerProcess

    sends = [BenchRequest(i, prompt, n) for i, (prompt, n) in enumerate(requests)]
    args = ["--max-num-seqs", str(MAX_NUM_SEQS)] + ([] if threads is None else ["--threads", str(threads)])
    with ServerProcess(args, model=model) as server:
        client = ClientConfig(server.url, model, ignore_eos=True)
        run_benchmark(client, sends[:1], [OpenLoop(float("inf"))], progress=False)  # warm-up, like offline's
        engine_pids = [int(pid) for pid in _children(server.pid)]
        cpu_before = {pid: _cpu_s(pid) for pid in [server.pid, *engine_pids]}
        result = run_benchmark(client, sends, [OpenLoop(float("inf"))], progress=False)
        front_end_cpu_s = _cpu_s(server.pid) - cpu_before[server.pid]
        engine_cpu_s = sum(_cpu_s(pid) - cpu_before[pid] for pid in engine_pids)
    summary, run = result.summaries[0], result.runs[0]
    if summary["ok"] != len(requests):
        raise RuntimeError(f"the server did not answer every request: {summary['errors']}")
    return {
        "output_tokens": summary["total_output_tokens"],
        "wall_s": run.duration_s,
        "client_cpu_s": run.client_cpu_s,
        "front_end_cpu_s": front_end_cpu_s,
        "engine_cpu_s": engine_cpu_s,
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
    }


def _children(pid: int) -> list[str]:
    """Child process ids (Linux): the server's engine core."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux; 0 elsewhere)."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return 0.0
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=256, help="prompt lengths are uniform in [16, this]")
    parser.add_argument("--max-output", type=int, default=128, help="output lengths are uniform in [16, this]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-threads", type=int, default=1, help="torch threads in the controlled pair")
    parser.add_argument("--side", choices=["offline"], help=argparse.SUPPRESS)  # internal: the offline process
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)  # with --side
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    requests = workload(args.requests, args.seed, args.max_prompt, args.max_output)
    if args.side == "offline":
        print(json.dumps(run_offline(args.model, requests, args.threads)))
        return 0

    forwarded = [f"--model={args.model}", f"--requests={args.requests}", f"--max-prompt={args.max_prompt}",
                 f"--max-output={args.max_output}", f"--seed={args.seed}", "--side=offline"]  # fmt: skip
    results = {}
    for name, threads in (("default", None), ("controlled", args.engine_threads)):  # None: each side's default
        thread_option = [] if threads is None else [f"--threads={threads}"]
        offline = subprocess.run([sys.executable, __file__, *forwarded, *thread_option], capture_output=True, text=True)
        if offline.returncode:
            sys.stderr.write(offline.stderr)
            return offline.returncode
        results[f"offline-{name}"] = json.loads(offline.stdout.strip().splitlines()[-1])
        results[f"server-{name}"] = run_server(args.model, requests, threads)
    for side in results.values():
        side["tokens_per_s"] = side["output_tokens"] / side["wall_s"]
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))
    return 0


def print_table(results: dict, args) -> None:
    shape = f"{args.requests} requests, prompts 16–{args.max_prompt}, outputs 16–{args.max_output} tokens"
    print(f"\n{shape}, {args.model}, torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}\n")
    print(f"{'side':<48}{'output tok/s':>14}{'server/offline':>16}{'wall s':>9}")
    pairs = (("default", "default threads"), ("controlled", f"{args.engine_threads} engine thread(s)"))
    for name, threads in pairs:
        offline, server = results[f"offline-{name}"], results[f"server-{name}"]
        ratio = f"{server['tokens_per_s'] / offline['tokens_per_s']:.2f}×"
        for side, r, shown in (("offline (LLM.generate)", offline, ""), ("server (HTTP, streamed)", server, ratio)):
            print(f"{side + ', ' + threads:<48}{r['tokens_per_s']:>14,.0f}{shown:>16}{r['wall_s']:>9.1f}")
        print(f"{'':<4}CPU s in the server run: engine core {server['engine_cpu_s']:.1f}, "
              f"front end {server['front_end_cpu_s']:.1f}, load tester {server['client_cpu_s']:.1f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

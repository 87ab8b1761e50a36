"""3× overload on the real server: admitted requests inside the SLO with deadline-aware admission, and without it.

    python benchmarks/overload.py                          # minserve-tiny, 16 slots, 1 s TTFT SLO (~8 minutes)
    python benchmarks/overload.py --duration 10 --multiples 3 --json out.json   # a quick look

One ``minserve serve`` per admission policy (``--policies``, default ``queue-length,deadline``), each in its
own process with the same engine settings. The capacity is measured once, on the first server, as the
requests per second a closed loop of ``2 × max-num-seqs`` users completes; every server is then offered an
open-loop Poisson stream at each multiple of it for ``--duration`` seconds (:mod:`minserve.bench.overload`).

The table is :func:`~minserve.bench.overload.overload_table`'s: every request sent is accounted for
(succeeded + refused + timed out + failed = sent), by the client and by the server's ``/metrics`` alike
(``server_accounted``); the admitted requests' TTFT percentiles; attainment of the admitted and of all
requests; goodput; and how fast the refusals came. Beside it, the server's memory (front end and engine core,
VmRSS sampled every ``--rss-every`` seconds over the run): flat when the server sheds what it cannot serve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from minserve import slo
from minserve.bench.client import ClientConfig
from minserve.bench.overload import measure_capacity, overload_table, run_overload
from minserve.bench.workload import LengthDist, WorkloadSpec
from minserve.serve.launch import MemorySampler, ServerProcess, engine_core_pid


def server_memory(server_pid: int, every_s: float) -> MemorySampler:
    """A sampler of the server's front end and its engine core."""
    return MemorySampler({"front_end": server_pid, "engine_core": engine_core_pid(server_pid)}, every_s)


def memory_mib(sampler: MemorySampler) -> dict[str, dict[str, float]]:
    """The sampler's first, largest and last sample of each process, in MiB."""
    return {name: {k: v / 2**20 for k, v in summary.items()} for name, summary in sampler.summary().items()}


def markdown(table) -> str:
    """A DataFrame as a markdown table (numbers to 3 significant figures)."""
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def server_args(policy: str, args: argparse.Namespace) -> list[str]:
    return ["--max-num-seqs", str(args.max_num_seqs), "--admission", policy, "--ttft-slo-ms", str(args.ttft_slo_ms)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--policies", default="queue-length,deadline", help="--admission values, one server each")
    parser.add_argument("--multiples", default="1,2,3", help="offered load, as multiples of the measured capacity")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per load")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length, corpus tokens")
    parser.add_argument("--output", type=int, default=32, help="output length, tokens (ignore_eos)")
    parser.add_argument("--client-timeout", type=float, default=60.0, help="seconds; past it the client hangs up")
    parser.add_argument("--rss-every", type=float, default=0.5, help="seconds between memory samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows and memory samples here")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    multiples = [float(m) for m in args.multiples.split(",") if m]
    workload = WorkloadSpec(64, LengthDist("fixed", args.prompt), LengthDist("fixed", args.output), seed=args.seed)
    contract = slo.SLO("ttft", ttft_s=args.ttft_slo_ms / 1e3)

    runs, memory, capacity_rps = [], {}, None
    for policy in policies:
        with ServerProcess(server_args(policy, args), model=args.model) as server:
            client = ClientConfig(
                server.url, args.model, ignore_eos=True, timeout_s=args.client_timeout, send_deadline=True
            )
            if capacity_rps is None:
                capacity_rps = measure_capacity(client, workload, concurrency=2 * args.max_num_seqs)
                print(f"capacity: {capacity_rps:.2f} requests/s", flush=True)
            with server_memory(server.pid, args.rss_every) as sampler:
                runs += run_overload(client, workload, capacity_rps, multiples, args.duration, contract, policy,
                                     args.seed)  # fmt: skip
            memory[policy] = memory_mib(sampler)
            print(f"{policy}: done", flush=True)

    table = overload_table(runs)
    print(f"\n`{' '.join(['python', *sys.argv])}`")
    machine = f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}"
    print(f"{args.model}, {args.max_num_seqs} slots, prompt {args.prompt} / output {args.output} tokens, "
          f"TTFT SLO {args.ttft_slo_ms:g} ms; {machine}\n")  # fmt: skip
    print(markdown(table))
    print("\nserver memory over the runs, MiB (first sample / max / last):\n")
    print("| policy | front end | engine core |\n|---|---|---|")
    for policy, parts in memory.items():
        cells = [f"{p['first']:.0f} / {p['max']:.0f} / {p['last']:.0f}" for p in parts.values()]
        print(f"| {policy} | {' | '.join(cells)} |")
    if args.json:
        rows = json.loads(table.to_json(orient="records"))
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "memory_mib": memory}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Retry storm: many clients against a briefly overloaded server, four ways to retry what it refuses.

    python benchmarks/retry_storm.py                      # minserve-tiny, 16 slots, deadline admission (~3 minutes)
    python benchmarks/retry_storm.py --strategies naive,jitter+budget --json out.json

One ``minserve serve`` (``--admission``, default ``deadline``), its capacity measured as a closed loop's
requests per second. Then, for each strategy in turn (:data:`minserve.bench.overload.STRATEGIES`), the same
storm (:class:`~minserve.bench.overload.StormShape`): a calm stream at half the capacity, a spike at
``--spike`` times it for ``--spike-s`` seconds, and calm again. The requests of one strategy share one
retrier, ``--max-attempts`` attempts each:

* ``naive`` retries at once, deaf to ``Retry-After``;
* ``fixed`` waits ``--base-s`` before every retry;
* ``jitter``: capped exponential backoff with full jitter, after the server's ``Retry-After``;
* ``jitter+budget``: the same, and retries at most 10% of the requests (:class:`minserve.client.RetryBudget`).

Printed: per strategy the attempts sent, successes, amplification (attempts per request) and recovery time
(seconds from the spike's end until the refusals stop: :func:`~minserve.bench.overload.recovery_s`), then
the offered load over time, attempts per second in each bin, retries included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overload import markdown

from minserve.bench import server_metrics
from minserve.bench.client import ClientConfig
from minserve.bench.overload import (
    STRATEGIES,
    StormShape,
    measure_capacity,
    run_retry_storm,
    storm_summary,
    storm_table,
)
from minserve.bench.workload import LengthDist, WorkloadSpec
from minserve.serve.launch import ServerProcess


def wait_until_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the server runs and queues nothing: one strategy's stragglers are not the next one's load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = server_metrics.scrape(url) or {}
        if not metrics.get("num_requests_running", 0) + metrics.get("num_requests_waiting", 0):
            return
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minserve-tiny")
    parser.add_argument("--admission", default="deadline")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--spike", type=float, default=4.0, help="the spike's load, multiples of capacity")
    parser.add_argument("--spike-s", type=float, default=4.0, help="the spike's length, seconds")
    parser.add_argument("--after-s", type=float, default=10.0, help="seconds of calm load after the spike")
    parser.add_argument("--max-attempts", type=int, default=8)
    parser.add_argument("--base-s", type=float, default=0.25, help="backoff base (fixed: the wait), seconds")
    parser.add_argument("--bin-s", type=float, default=1.0, help="time bin of the load table, seconds")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--client-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workload = WorkloadSpec(64, LengthDist("fixed", args.prompt), LengthDist("fixed", args.output), seed=args.seed)
    server_options = ["--max-num-seqs", str(args.max_num_seqs), "--admission", args.admission,
                      "--ttft-slo-ms", str(args.ttft_slo_ms)]  # fmt: skip

    runs = []
    with ServerProcess(server_options, model=args.model) as server:
        client = ClientConfig(server.url, args.model, ignore_eos=True, timeout_s=args.client_timeout)
        capacity_rps = measure_capacity(client, workload, concurrency=2 * args.max_num_seqs)
        shape = StormShape(capacity_rps, args.spike, args.spike_s, after_s=args.after_s)
        print(f"capacity: {capacity_rps:.2f} requests/s; {len(shape.timetable(args.seed))} requests", flush=True)
        for strategy in args.strategies.split(","):
            wait_until_idle(server.url)
            run = run_retry_storm(client, strategy, workload, shape, args.seed, max_attempts=args.max_attempts,
                                  base_s=args.base_s)  # fmt: skip
            runs.append(run)
            print(f"{strategy}: {len(run.attempts)} attempts in {run.duration_s:.1f} s", flush=True)

    summary, load = storm_summary(runs, args.bin_s), storm_table(runs, args.bin_s)
    print(f"\n`{' '.join(['python', *sys.argv])}`")
    print(f"{args.model}, {args.max_num_seqs} slots, --admission {args.admission}; capacity {capacity_rps:.2f} "
          f"requests/s, spike {args.spike:g}× for {args.spike_s:g} s (from {shape.before_s:g} s to "
          f"{shape.spike_end_s:g} s); torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}\n")  # fmt: skip
    print(markdown(summary))
    print("\nattempts per second (offered load, retries included), by time bin:\n")
    wide = load.pivot(index="t_s", columns="strategy", values="attempts_per_s").reset_index()
    print(markdown(wide[["t_s", *[r.strategy for r in runs]]]))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "capacity_rps": capacity_rps,
                                         "summary": json.loads(summary.to_json(orient="records")),
                                         "load": json.loads(load.to_json(orient="records"))}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

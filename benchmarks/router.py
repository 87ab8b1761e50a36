"""Data parallelism: two ``minserve serve`` replicas behind ``minserve route``, once per routing policy.

    python benchmarks/router.py                      # minserve-tiny, 2 replicas of 1 thread (~2 minutes on 2 cores)
    python benchmarks/router.py --json benchmarks/results/router-cpu-2026-12-05.json

The workload is a chat service's: ``--prefixes`` distinct long system prompts (``--prefix-len`` tokens of
Python-like text each), ``--per-prefix`` requests under each with a short question of their own
(``--question-len`` tokens) and a ``--output-len``-token answer (greedy, ``ignore_eos``), in a seeded random
order, sent by ``minserve bench``'s closed loop at ``--concurrency`` through the router.

The replicas stay up for all three runs; the router is started afresh for each policy, in its own process.
Each run's prompts begin with a line of their own (``run_benchmark``'s salt), so nothing one policy's run
cached helps the next. Each replica has ``--kv-blocks`` KV blocks, sized so that one replica holds
about half the prefixes beside its running requests but not all of them: that is where routing matters.
Round-robin and least-outstanding send every prefix to both replicas, so each replica's cache must hold all of
them and evicts, and each prefix is computed at least twice; prefix-aware sends each prefix to one replica,
so the two caches together hold the prefixes once.

Per policy it prints throughput (requests/s, output tokens/s) and TTFT p50/p99 as the client saw them, the
requests each replica served and its prefix-cache hit rate (prompt tokens found cached / prompt tokens,
from the replica's own ``/metrics`` before and after the run), and the total hit rate.
On a small CPU everything (two replicas, each a front end and an engine core, the router and the load
tester) shares the cores: compare the policies with each other, not with a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from minserve.bench.arrivals import ClosedLoop
from minserve.bench.benchmark import git_commit, relabel, run_benchmark
from minserve.bench.client import ClientConfig
from minserve.bench.server_metrics import difference, scrape
from minserve.bench.workload import BenchRequest, sized_text
from minserve.model.loader import resolve_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.serve.launch import free_port, start_servers
from minserve.serve.routing import ROUTING_POLICIES

MODEL = "minserve-tiny"


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """``prefixes × per_prefix`` requests, each a system prefix and a question of its own, shuffled (seeded)."""
    tokenizer = Tokenizer(resolve_model_path(MODEL))
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731  exact lengths in the server's tokens
    rng = random.Random(args.seed)
    prefixes = [f"# system prompt {p}\n" + sized_text(rng, args.prefix_len, count) for p in range(args.prefixes)]
    prompts = [prefix + "\n" + sized_text(rng, args.question_len, count) for prefix in prefixes
               for _ in range(args.per_prefix)]  # fmt: skip
    rng.shuffle(prompts)
    return [BenchRequest(i, prompt, args.output_len) for i, prompt in enumerate(prompts)]


class RouterProcess:
    """``minserve route`` over ``urls`` in a child process, waited for, stopped with SIGTERM."""

    def __init__(self, urls: list[str], policy: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "minserve.cli", "route", "--policy", policy, "--log-level", "warning",
                   "--port", self.url.rsplit(":", 1)[1], *(f"--replica={url}" for url in urls)]  # fmt: skip
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("minserve route did not become healthy in 60 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def replica_counts(before: dict, after: dict) -> dict:
    """What one replica did in a run, from its ``/metrics`` before and after."""
    delta = difference(before, after)
    hits, queries = delta["prefix_cache_hits_total"], delta["prefix_cache_queries_total"]
    finished = sum(v for k, v in delta.items() if k.startswith("request_success_total"))
    return {"requests": round(finished), "prefix_hits": hits, "prompt_tokens": queries,
            "hit_rate": hits / queries if queries else None}  # fmt: skip


def run_policy(policy: str, urls: list[str], requests: list[BenchRequest], args: argparse.Namespace) -> dict:
    router = RouterProcess(urls, policy)
    try:
        before = [scrape(url) for url in urls]
        client = ClientConfig(router.url, MODEL, ignore_eos=True)
        result = run_benchmark(client, requests, [ClosedLoop(args.concurrency)], progress=False)
        result = relabel(result, policy)
        replicas = [replica_counts(b, scrape(url)) for b, url in zip(before, urls)]
    finally:
        router.stop()
    summary = result.summaries[0]
    if summary["ok"] != len(requests):
        raise RuntimeError(f"{policy}: {summary['failed']} requests failed: {summary['errors']}")
    hits = sum(r["prefix_hits"] for r in replicas)
    tokens = sum(r["prompt_tokens"] for r in replicas)
    return {
        "policy": policy,
        "request_throughput_rps": summary["request_throughput_rps"],
        "output_throughput_tps": summary["output_throughput_tps"],
        "ttft_ms": {key: summary["ttft_ms"][key] for key in ("p50", "p99")},
        "e2e_ms": {key: summary["e2e_ms"][key] for key in ("p50", "p99")},
        "replicas": replicas,
        "hit_rate": hits / tokens if tokens else None,
    }


def format_table(rows: list[dict]) -> str:
    header = f"{'policy':<18}{'req/s':>7}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
    header += f"   {'per replica: requests, hit rate':<32}{'total':>8}"
    lines = [header, "-" * len(header)]
    for row in rows:
        per = "  ".join(f"{r['requests']:>3} {r['hit_rate']:>4.0%}" for r in row["replicas"])
        lines.append(
            f"{row['policy']:<18}{row['request_throughput_rps']:>7.1f}{row['output_throughput_tps']:>8.0f}"
            f"{row['ttft_ms']['p50']:>8.0f}ms{row['ttft_ms']['p99']:>8.0f}ms   {per:<32}{row['hit_rate']:>8.0%}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--per-prefix", type=int, default=16, help="requests under each")
    parser.add_argument("--prefix-len", type=int, default=384, help="tokens of each system prompt")
    parser.add_argument("--question-len", type=int, default=24, help="tokens of each request's own")
    parser.add_argument("--output-len", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    parser.add_argument("--kv-blocks", type=int, default=192, help="KV blocks of 16 tokens per replica")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the settings and rows here")
    args = parser.parse_args()

    requests = build_workload(args)
    replica_args = ["--threads", str(args.threads), "--num-kv-blocks", str(args.kv_blocks)]
    servers = start_servers(2, replica_args, MODEL)
    try:
        urls = [server.url for server in servers]
        for url in urls:  # warm-up: each replica's first steps (allocations, first kernels) are no policy's
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8}, timeout=60)
        rows = [run_policy(policy, urls, requests, args) for policy in args.policies.split(",")]
    finally:
        for server in servers:
            server.stop()

    print(f"{len(requests)} requests: {args.prefixes} system prompts of {args.prefix_len} tokens × {args.per_prefix}, "
          f"{args.question_len}-token questions, {args.output_len}-token answers, closed loop at {args.concurrency}; "
          f"2 replicas of {MODEL}, {args.threads} thread and {args.kv_blocks} KV blocks each\n")  # fmt: skip
    print(format_table(rows))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        environment = {"platform": platform.platform(), "cpus": os.cpu_count(), "git_commit": git_commit()}
        args.json.write_text(json.dumps({"settings": settings, "environment": environment, "rows": rows}, indent=2))
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()

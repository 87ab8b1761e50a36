"""Part 3 of ``vs_llamacpp.py``: ``minserve serve`` and ``llama-server`` under the same load, side by side.

Each server runs alone and gets the same two loads from ``minserve bench serve``: Poisson arrivals at each
rate, then a closed loop of N clients at once. Every request asks for exactly ``--serve-output-len`` tokens
(``ignore_eos``); a run where any request failed or came back short is marked, since a request cut short would
read as a fast server. Goodput is judged against a chat SLO (TTFT and TPOT).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from llamacpp_peer import MODEL, LlamaServer, gguf_path


def bench_serve(base_url: str, args, out: Path, load: list[str]) -> list[dict]:
    """``minserve bench serve`` as a user runs it, under ``load`` (``--rates …`` or ``--concurrencies …``),
    judged against the chat SLO: the summaries it writes to ``out/summary.json``."""
    command = [sys.executable, "-m", "minserve.cli", "bench", "serve", "--base-url", base_url, "--model", MODEL,
               "--prompt-len", str(args.serve_prompt_len), "--output-len", str(args.serve_output_len),
               "--tokenizer", MODEL, "--ignore-eos", "--slo-ttft-ms", str(args.slo_ttft_ms),
               "--slo-tpot-ms", str(args.slo_tpot_ms), *load, "--out", str(out), "--no-bundle",
               "--no-progress"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    runs = json.loads((out / "summary.json").read_text())["runs"]
    for run in runs:  # a request cut short would read as a fast server
        run["complete"] = run["failed"] == 0 and run["total_output_tokens"] == run["ok"] * args.serve_output_len
    return runs


def serve_loads(args) -> dict[str, list[str]]:
    """The two loads every server gets: Poisson arrivals at each rate, then a closed loop of N at once."""
    return {
        "poisson": ["--rates", args.serve_rates, "--num-prompts", str(args.serve_prompts)],
        "closed": ["--concurrencies", str(args.serve_concurrency), "--num-prompts", str(2 * args.serve_concurrency)],
    }


def run_serve(args, out_root: Path) -> dict:
    """Each server alone, under the same loads: ``minserve serve`` with its defaults (and each
    ``--minserve-flags`` variant), then ``llama-server`` with each ``--llama-slots`` count."""
    from minserve.serve.launch import ServerProcess, free_port

    results = {}
    for flags in ["", *args.minserve_flags]:
        name = f"minserve serve {flags}".strip()
        with ServerProcess(flags.split(), model=MODEL, startup_timeout_s=600) as server:
            results[name] = {load: bench_serve(server.url, args, out_root / name / load, options)
                             for load, options in serve_loads(args).items()}  # fmt: skip
    for slots in (int(n) for n in args.llama_slots.split(",")):
        name = f"llama-server -np {slots}"
        with LlamaServer(gguf_path(), free_port(), args.serve_threads, slots, alias=MODEL) as server:
            results[name] = {load: bench_serve(server.url, args, out_root / name / load, options)
                             for load, options in serve_loads(args).items()}  # fmt: skip
    return results


def print_serve(results: dict, args) -> None:
    print(f"\n3. serve: {args.serve_prompt_len} prompt tokens, {args.serve_output_len} output tokens, SLO TTFT "
          f"{args.slo_ttft_ms:.0f} ms and TPOT {args.slo_tpot_ms:.0f} ms; Poisson {args.serve_prompts} requests per "
          f"rate, closed loop {args.serve_concurrency} at once\n")  # fmt: skip
    width = max(len(server) for server in results) + 2
    print(f"{'server':<{width}}{'load':>16}{'ok':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'good/s':>8}{'out tok/s':>11}{'all tokens':>11}")  # fmt: skip
    for server, loads in results.items():
        for run in (run for runs in loads.values() for run in runs):
            ttft, tpot = run["ttft_ms"], run["tpot_ms"]
            print(f"{server:<{width}}{run['label']:>16}{run['ok']:>5}{ttft['p50']:>10,.0f}{ttft['p99']:>10,.0f}"
                  f"{tpot['p50']:>10,.1f}{tpot['p99']:>10,.1f}{run['goodput_rps']:>8.2f}"
                  f"{run['output_throughput_tps']:>11,.1f}{'yes' if run['complete'] else 'NO':>11}")  # fmt: skip
    print_serve_summary(results)


def serve_summary(loads: dict) -> dict[str, float]:
    """One server's row of the comparison: closed-loop throughput, best goodput over the rates, and the
    TPOT p50 at the lowest rate (what one user sees when the server is nearly idle)."""
    poisson, (closed,) = loads["poisson"], loads["closed"]
    return {"closed_tokens_per_s": closed["output_throughput_tps"],
            "best_goodput_rps": max(run["goodput_rps"] for run in poisson),
            "tpot_p50_ms_lowest_rate": poisson[0]["tpot_ms"]["p50"]}  # fmt: skip


def print_serve_summary(results: dict, peer: str = "llama-server -np 8") -> None:
    """The comparison table, each server's row with its ratio to ``peer`` (TPOT: lower is better)."""
    rows = {server: serve_summary(loads) for server, loads in results.items()}
    base = rows.get(peer)
    width = max(len(server) for server in rows) + 2
    print(f"\n{'server':<{width}}{'closed tok/s':>16}{'best good/s':>16}{'TPOT p50 at lowest rate':>25}")
    for server, row in rows.items():
        ratios = [row[k] / base[k] for k in row] if base else [math.nan] * 3
        cells = [f"{row[k]:,.2f} ({ratio:.2f}×)" for k, ratio in zip(row, ratios)]
        print(f"{server:<{width}}{cells[0]:>16}{cells[1]:>16}{cells[2]:>25}")
    if base:
        print(f"(ratios to {peer})")

"""``minserve bench serve``: load-test an OpenAI-compatible server and write the evidence to ``--out``."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minserve import slo
from minserve.bench.arrivals import ARRIVALS, ClosedLoop, OpenLoop, parse_concurrencies, parse_rates
from minserve.bench.workload import WorkloadSpec, build_requests, parse_length

LENGTH_HELP = "N (fixed), uniform:MEAN:SPREAD or lognormal:MEAN:SD, in tokens"


def add_bench_command(commands: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its sub-command ``serve`` on the top-level parser's sub-commands."""
    bench = commands.add_parser("bench", help="load-test a server", description="Load testing (chapter 10).")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    serve = kinds.add_parser(
        "serve", help="load-test an OpenAI-compatible server", description=_cmd_bench_serve.__doc__
    )
    _add_target_arguments(serve)
    _add_retry_arguments(serve)
    _add_workload_arguments(serve)
    _add_arrival_arguments(serve)
    _add_slo_arguments(serve)
    _add_report_arguments(serve)
    serve.set_defaults(run=_cmd_bench_serve)
    report = kinds.add_parser("report", help="rebuild report.html from a run", description=_cmd_bench_report.__doc__)
    report.add_argument("dir", type=Path, help="a directory a `minserve bench serve` run wrote")
    report.set_defaults(run=_cmd_bench_report)
    compare = kinds.add_parser("compare", help="two or more runs side by side", description=_cmd_bench_compare.__doc__)
    compare.add_argument("dirs", type=Path, nargs="+", metavar="DIR", help="directories `minserve bench serve` wrote")
    compare.add_argument("--out", type=Path, default=Path("compare.html"), help="the comparison page to write")
    compare.set_defaults(run=_cmd_bench_compare)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    group.add_argument("--model", default="minserve-tiny", help="the model name the server expects")
    group.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    group.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    group.add_argument("--timeout-s", type=float, default=600.0, help="per request, send to last byte")
    group.add_argument("--send-deadline", action="store_true",
                       help="send --timeout-s as the request's deadline (X-Request-Timeout; minserve stops the "
                            "request there: client and /metrics agree on what timed out)")  # fmt: skip
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true", help="exactly max_tokens (ignore_eos, min_tokens)")


def _add_retry_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("retries (minserve.client; off by default: every request is sent once)")
    group.add_argument("--retries", type=int, default=0, help="retries of a request refused for load (429, 503)")
    group.add_argument("--retry-base-s", type=float, default=0.5, help="backoff before retry n: up to base·2^n")
    group.add_argument("--retry-cap-s", type=float, default=30.0, help="… and never more than this (full jitter)")
    group.add_argument("--retry-budget", type=float, default=None, help="retries ≤ this share of requests (10 s)")
    group.add_argument("--adaptive-throttle-k", type=float, default=None, help="refuse locally past k × accepted")


def _retrier_from_args(args: argparse.Namespace) -> Callable[[], Any] | None:
    """What makes each run's retrier (seeded from --seed), or None without retries or a throttle."""
    if args.retries < 0:
        raise ValueError(f"--retries must be ≥ 0, got {args.retries}")
    if args.retries == 0 and args.adaptive_throttle_k is None:
        return None
    from minserve.client import AdaptiveThrottle, Retrier, RetryBudget, RetryPolicy

    def make() -> Retrier:
        policy = RetryPolicy(args.retries + 1, args.retry_base_s, args.retry_cap_s, random.Random(args.seed))
        budget = None if args.retry_budget is None else RetryBudget(args.retry_budget)
        k = args.adaptive_throttle_k
        throttle = None if k is None else AdaptiveThrottle(k, rng=random.Random(args.seed + 1))
        return Retrier(policy, budget, throttle)

    make()  # a mistaken setting fails now, before the run
    return make


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    group.add_argument("--prompt-len", default="128", help=LENGTH_HELP)
    group.add_argument("--output-len", default="64", help=LENGTH_HELP)
    group.add_argument("--max-prompt-len", type=int, default=4096, help="clip prompt lengths to this")
    group.add_argument("--max-output-len", type=int, default=1024, help="clip output lengths to this")
    group.add_argument("--dataset", type=Path, default=None, help='JSONL of {"prompt": ..., "max_tokens": ...}')
    group.add_argument("--shared-prefix-fraction", type=float, default=0.0, help="share of requests with it")
    group.add_argument("--shared-prefix-len", type=int, default=0, help="shared prefix length in tokens")
    group.add_argument("--cancel-fraction", type=float, default=0.0, help="share of requests cancelled")
    group.add_argument("--cancel-after-chunks", type=int, default=4, help="cancel after this many chunks")
    group.add_argument("--seed", type=int, default=0)


def _add_arrival_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("arrivals (open loop by default)")
    loads = group.add_mutually_exclusive_group()
    loads.add_argument("--rates", default="1", help="open loop: requests/s, comma-separated sweep; inf = all at once")
    loads.add_argument("--concurrencies", default=None, help="closed loop instead: comma-separated sweep")
    group.add_argument("--arrival", default="poisson", choices=list(ARRIVALS))
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier, 1 = Poisson")


def _add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLO for goodput (unset targets are not part of it)")
    for key in ("ttft", "tpot", "e2e", "max_itl"):
        group.add_argument(f"--slo-{key.replace('_', '-')}-ms", type=float, default=None, dest=f"slo_{key}_ms")
    group.add_argument("--slo-availability", type=float, default=0.999, help="ok / (ok + failed) at least this")
    group.add_argument("--slo-attainment", type=float, default=0.99, help="share of requests that must meet it")


def _slo_from_args(args: argparse.Namespace) -> slo.SLO | None:
    targets_ms = {key: getattr(args, f"slo_{key}_ms") for key in ("ttft", "tpot", "e2e", "max_itl")}
    targets = {f"{key}_s": value_ms / 1e3 for key, value_ms in targets_ms.items() if value_ms is not None}
    return slo.SLO(name="cli", availability=args.slo_availability, **targets) if targets else None


def _arrivals_from_args(args: argparse.Namespace) -> list[OpenLoop | ClosedLoop]:
    if args.concurrencies:
        return [ClosedLoop(c) for c in parse_concurrencies(args.concurrencies)]
    if args.burstiness != 1.0 and args.arrival != "gamma":
        raise ValueError("--burstiness applies to --arrival gamma only")
    # One seed per run: one shared seed would make every rate's timetable the same one, rescaled.
    rates = parse_rates(args.rates)
    return [OpenLoop(rate, args.arrival, args.burstiness, args.seed + i) for i, rate in enumerate(rates)]


def _workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        num_requests=args.num_prompts,
        prompt_len=parse_length(args.prompt_len, args.max_prompt_len),
        output_len=parse_length(args.output_len, args.max_output_len),
        shared_prefix_fraction=args.shared_prefix_fraction,
        shared_prefix_len=args.shared_prefix_len,
        cancel_fraction=args.cancel_fraction,
        cancel_after_chunks=args.cancel_after_chunks,
        dataset=args.dataset,
        seed=args.seed,
    )


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for the evidence")
    group.add_argument("--usd-per-hour", type=float, default=None, help="accelerator price, for $ per M tokens")
    group.add_argument("--accelerators", type=int, default=1, help="accelerators behind the server")
    group.add_argument(
        "--tokenizer", default=None, help="the model's tokenizer (dir or hub id): exact prompt lengths, local counts"
    )
    group.add_argument("--no-bundle", action="store_true", help="skip report.html")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config_record(args: argparse.Namespace) -> dict[str, Any]:
    """The run's configuration as summary.json keeps it (the API key left out)."""
    options = {k: _jsonable(v) for k, v in vars(args).items() if k != "run"}
    options["api_key"] = "***" if args.api_key else None
    return {"argv": sys.argv[1:], "options": options}


def _token_counter(tokenizer: str | None) -> Callable[[str], int] | None:
    """``text → number of tokens`` with the model's own tokenizer, for servers that report no usage."""
    if tokenizer is None:
        return None
    from minserve.model.loader import resolve_model_path
    from minserve.model.tokenizer import Tokenizer

    local = Tokenizer(resolve_model_path(tokenizer))
    return lambda text: len(local.encode(text))


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    """Send a seeded workload to an OpenAI-compatible server (open or closed loop, optionally a sweep) and
    write the evidence to --out: records.jsonl (every request), summary.json and report.html."""
    # Imported here, not at the top: httpx is the server extra, and `minserve --help` must not need it.
    from minserve.bench.benchmark import run_benchmark
    from minserve.bench.client import ClientConfig
    from minserve.bench.metrics import Pricing
    from minserve.bench.report import format_table

    workload, arrivals, contract = _workload_from_args(args), _arrivals_from_args(args), _slo_from_args(args)
    pricing = Pricing(args.usd_per_hour, args.accelerators) if args.usd_per_hour is not None else None
    count_tokens = _token_counter(args.tokenizer)
    client = ClientConfig(
        args.base_url,
        args.model,
        args.endpoint,
        args.api_key,
        args.timeout_s,
        args.temperature,
        args.ignore_eos,
        count_tokens=count_tokens,
        make_retrier=_retrier_from_args(args),
        send_deadline=args.send_deadline,
    )
    result = run_benchmark(
        client,
        build_requests(workload, count_tokens),
        arrivals,
        contract,
        pricing,
        required_attainment=args.slo_attainment,
        progress=not args.no_progress,
        config=_config_record(args) | {"workload": _jsonable(dataclasses.asdict(workload))},
    )
    out = result.save(args.out, bundle=not args.no_bundle)
    print(format_table(result.summaries))
    for summary in result.summaries:
        if "verdict" in summary:
            print(f"{summary['label']}: SLO {'PASS' if summary['verdict']['passed'] else 'FAIL'}")
    written = ["records.jsonl", "summary.json"] + ([] if args.no_bundle else ["report.html"])
    print(f"\nevidence in {out}/: {', '.join(written)}")
    return 0


def _cmd_bench_report(args: argparse.Namespace) -> int:
    """Rebuild report.html from the records.jsonl and summary.json in a directory."""
    from minserve.bench.bundle import write_bundle

    print(write_bundle(args.dir))
    return 0


def _cmd_bench_compare(args: argparse.Namespace) -> int:
    """Two or more runs side by side (say, two servers under the same workload): for every run label they
    share, throughput, goodput and tail latencies with each one's ratio to the first DIR, and a page with
    the sweeps overlaid and the latency CDFs of each shared run."""
    from minserve.bench.compare import format_comparison, write_comparison

    try:
        bundles, out = write_comparison(args.dirs, args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"minserve bench compare: {error}", file=sys.stderr)
        return 2
    print(format_comparison(bundles))
    print(f"\ncomparison in {out}")
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return None
    return value

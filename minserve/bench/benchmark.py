"""A whole benchmark: a workload at each load setting, summarized, cross-checked, and saved as evidence.

    result = run_benchmark(ClientConfig("http://127.0.0.1:8000", "minserve-tiny"), build_requests(spec),
                           [OpenLoop(1.0), OpenLoop(4.0)], contract=slo.SLO(ttft_s=0.5))
    result.save("bench-out")        # records.jsonl, summary.json and report.html

Around each run it reads the server's ``/metrics`` (when it has one), so the summary holds the server's own
count beside the client's. ``minserve bench serve`` is a thin command line over :func:`run_benchmark`.
"""

from __future__ import annotations

import datetime
import os
import platform
import secrets
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from minserve import slo
from minserve.bench import server_metrics
from minserve.bench.arrivals import ClosedLoop, OpenLoop
from minserve.bench.client import ClientConfig
from minserve.bench.metrics import Pricing, summarize
from minserve.bench.report import write_records, write_summary
from minserve.bench.runner import RunResult, run_once, run_sync
from minserve.bench.workload import BenchRequest

SETTLE_TIMEOUT_S = 10.0  # after a run, how long to wait for the server to finish cancelled requests


@dataclass
class BenchmarkResult:
    """The runs of one benchmark, their summaries (with the server's counts) and what they ran in."""

    runs: list[RunResult]
    summaries: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    def save(self, out_dir: str | Path, bundle: bool = True) -> Path:
        """Write ``records.jsonl``, ``summary.json`` and (with ``bundle``) ``report.html``; return the directory."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_records(out / "records.jsonl", self.runs)
        write_summary(out / "summary.json", self.config, self.summaries, self.environment)
        if bundle:
            from minserve.bench.bundle import write_bundle  # plotly: only needed for the HTML

            write_bundle(out)
        return out


def relabel(result: BenchmarkResult, *labels: str) -> BenchmarkResult:
    """The same runs under new labels (one per run, in order): the arrival alone names a run ``rate=4``, and
    two workloads at the same rate would share a label, and be pooled by anything that groups by it."""
    if len(labels) != len(result.runs):
        raise ValueError(f"{len(result.runs)} runs need {len(result.runs)} labels, got {len(labels)}")
    runs = [replace(run, label=label) for run, label in zip(result.runs, labels)]
    summaries = [{**summary, "label": label} for summary, label in zip(result.summaries, labels)]
    return BenchmarkResult(runs, summaries, result.config, result.environment)


def run_benchmark(
    client: ClientConfig,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[OpenLoop | ClosedLoop],
    contract: slo.SLO | None = None,
    pricing: Pricing | None = None,
    required_attainment: float = 0.99,
    progress: bool = True,
    config: dict[str, Any] | None = None,
    salt_runs: bool = True,
) -> BenchmarkResult:
    """Send ``requests`` at each arrival setting in turn (lowest load first is the caller's choice).

    With ``salt_runs``, each run's text prompts start with a line of their own (``# run <nonce> <label>``):
    the same work every run, but nothing one run sent is in the server's prefix cache for the next (a cache
    names blocks by a hash chain from the first token). Within a run, a shared prefix is still shared.
    Without it, every run after the first would partly measure the cache. Callable from a notebook cell.
    """
    environment = describe_environment(client)
    nonce = secrets.token_hex(4)  # new on every call: a second benchmark against the same server is fresh too
    runs, summaries = [], []
    for arrival in arrivals:
        sent = salted(requests, f"# run {nonce} {arrival.label}") if salt_runs else requests
        before = server_metrics.scrape(client.base_url, client.headers())
        run = run_sync(run_once(sent, arrival, client, progress))
        summary = summarize(run, contract, pricing, required_attainment)
        after = wait_until_idle(client)
        if before is not None and after is not None:
            summary["server"] = server_metrics.difference(before, after)
        runs.append(run)
        summaries.append(summary)
    config = (config or {}) | {"salt": f"each run's prompts start with '# run {nonce} LABEL'" if salt_runs else None}
    return BenchmarkResult(runs, summaries, config, environment)


def salted(requests: Sequence[BenchRequest], salt: str) -> list[BenchRequest]:
    """The requests with ``salt`` as the first line of every text prompt; token-id prompts stay as they are."""
    return [replace(r, prompt=f"{salt}\n{r.prompt}") if isinstance(r.prompt, str) else r for r in requests]


def wait_until_idle(client: ClientConfig, timeout_s: float = SETTLE_TIMEOUT_S) -> dict[str, float] | None:
    """The server's metrics once it runs and queues nothing (cancelled requests take a step to leave)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server_metrics.scrape(client.base_url, client.headers())
        busy = metrics and metrics.get("num_requests_running", 0) + metrics.get("num_requests_waiting", 0)
        if not busy or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def describe_environment(client: ClientConfig) -> dict[str, Any]:
    """Where the client ran, which minserve commit it was, and what the server says it serves."""
    from minserve import __version__

    return {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "client_host": platform.node(),
        "client_platform": platform.platform(),
        "client_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "minserve": __version__,
        "git_commit": git_commit(),
        "server": client.base_url,
        "server_models": served_models(client),
    }


def git_commit() -> str | None:
    """The commit of the minserve checkout this runs from (with ``-dirty`` for uncommitted changes)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def served_models(client: ClientConfig) -> list[str] | None:
    """The model ids ``GET /v1/models`` lists, or ``None`` when it cannot be read."""
    try:
        response = httpx.get(client.base_url.rstrip("/") + "/v1/models", headers=client.headers(), timeout=10)
        return [model["id"] for model in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None

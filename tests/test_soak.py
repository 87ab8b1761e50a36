"""Soak: thousands of requests (streams, cancellations, plain requests and bad ones) against a server in its
own process leave no KV block held, no request unaccounted for, and the server's memory flat."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest

from minserve.bench.arrivals import ClosedLoop
from minserve.bench.benchmark import run_benchmark
from minserve.bench.client import ClientConfig
from minserve.bench.server_metrics import finished_by_reason, parse_metrics
from minserve.bench.workload import LengthDist, WorkloadSpec, build_requests
from minserve.serve.launch import ServerProcess

MODEL = "minserve-tiny"
ROUNDS = 3
STREAMS_PER_ROUND = 800  # plus PLAIN and BAD: a thousand requests a round
PLAIN_PER_ROUND = 100
BAD_PER_ROUND = 100
BAD_BODIES = (
    b"{not json",
    json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(),
    json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(),
    json.dumps({"model": "gpt-9", "prompt": "x"}).encode(),
    json.dumps({"model": MODEL, "prompt": [1] * 5000}).encode(),
)


async def _plain_and_bad(url: str, round_index: int) -> Counter:
    """The round's plain (non-streaming) requests and bad ones, a few at a time; their status codes."""
    limit = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def post(content: bytes) -> int:
            async with limit:
                response = await http.post(
                    "/v1/completions", content=content, headers={"content-type": "application/json"}
                )
                return response.status_code

        plain = json.dumps({"model": MODEL, "prompt": f"x{round_index} = ", "max_tokens": 3}).encode()
        bodies = [plain] * PLAIN_PER_ROUND + [BAD_BODIES[i % len(BAD_BODIES)] for i in range(BAD_PER_ROUND)]
        return Counter(await asyncio.gather(*(post(body) for body in bodies)))


@pytest.mark.slow
def test_soak_leaves_nothing_behind():
    # One engine thread: the load tester runs in this process on the same cores, and the soak is about what
    # is left behind, not speed.
    args = ["--max-num-seqs", "32", "--num-kv-blocks", "512", "--threads", "1"]
    with ServerProcess(args, model=MODEL) as server:
        client = ClientConfig(server.url, MODEL, ignore_eos=True)
        statuses: Counter = Counter()
        codes: Counter = Counter()
        rss_after_round = []
        for round_index in range(ROUNDS):
            spec = WorkloadSpec(
                num_requests=STREAMS_PER_ROUND,
                prompt_len=LengthDist("uniform", 12, 8),
                output_len=LengthDist("uniform", 4, 2),
                shared_prefix_fraction=0.3,
                shared_prefix_len=16,
                cancel_fraction=0.2,
                cancel_after_chunks=1,
                seed=round_index,
            )
            result = run_benchmark(client, build_requests(spec), [ClosedLoop(24)], progress=False)
            statuses.update(r.status for r in result.runs[0].results)
            codes.update(asyncio.run(_plain_and_bad(server.url, round_index)))
            rss_after_round.append(server.rss_bytes())

        server_side = _wait_for_idle_metrics(server.url)
    finished = finished_by_reason(server_side)
    sent = ROUNDS * (STREAMS_PER_ROUND + PLAIN_PER_ROUND + BAD_PER_ROUND)
    # Every request is accounted for, on both sides.
    assert statuses["failed"] == 0, statuses
    assert sum(statuses.values()) + sum(codes.values()) == sent
    assert codes[200] == ROUNDS * PLAIN_PER_ROUND
    assert sum(n for code, n in codes.items() if 400 <= code < 500) == ROUNDS * BAD_PER_ROUND
    # Each request that reached the engine finished there exactly once. A client that hangs up after the
    # first chunk of a short answer may be too late: the server finished it first, so abort ≤ cancelled.
    assert sum(finished.values()) == statuses["ok"] + statuses["cancelled"] + codes[200]
    assert 0 < finished.get("abort", 0) <= statuses["cancelled"]
    rejected = sum(v for k, v in server_side.items() if k.startswith("requests_rejected_total"))
    assert rejected == ROUNDS * BAD_PER_ROUND
    # Nothing is held once the load is gone.
    assert server_side["kv_cache_usage_perc"] == 0.0
    assert server_side["num_requests_running"] == server_side["num_requests_waiting"] == 0
    # Memory flat: the last thousand requests left the server within 10% of where the first thousand did.
    first, last = rss_after_round[0], rss_after_round[-1]
    assert first > 0 and abs(last - first) <= 0.10 * first, rss_after_round


def _wait_for_idle_metrics(url: str, attempts: int = 200) -> dict[str, float]:
    """The server's metrics once nothing runs (the last cancellations land at the engine's next step)."""
    for _ in range(attempts):
        metrics = parse_metrics(httpx.get(url + "/metrics").text)
        if metrics["num_requests_running"] == metrics["num_requests_waiting"] == metrics["kv_cache_usage_perc"] == 0:
            return metrics
        time.sleep(0.05)
    return metrics

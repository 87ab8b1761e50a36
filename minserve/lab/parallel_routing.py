"""Chapter 06's data parallelism without HTTP: the router's own policies (:mod:`minserve.serve.routing`) place
a chat service's requests on replicas that are engines in this process, and each replica's prefix cache says
what the placement was worth.

The requests go one at a time, as a router would send them to idle replicas: a request is placed, served,
and answered before the next is placed. So every replica has nothing in flight when a policy chooses, the
placement depends on the policy and the prompts alone (:func:`place`), and the prefix-cache hits it earns
can be predicted before anything runs (:func:`predicted_cached_tokens`): a request finds the full blocks it
shares with an earlier prompt *on the same replica*, and nothing from the other replicas' caches.
``benchmarks/router.py`` measures the same policies over HTTP, concurrently, behind ``minserve route``
(:func:`router_benchmark_table` reads what it recorded).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from minserve.bench.workload import sized_text
from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.serve.routing import Replica, RoutingPolicy, make_routing_policy, rendezvous

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ROUTER_RESULTS = RESULTS_DIR / "router-cpu-2026-12-05.json"


@dataclass(frozen=True)
class ChatRequest:
    """One request of the workload: which system prompt it starts with, and its whole prompt."""

    prefix: int
    prompt: str


def chat_workload(
    llm: LLM, num_prefixes: int = 8, per_prefix: int = 4, prefix_tokens: int = 192, question_tokens: int = 16,
    seed: int = 0,
) -> list[ChatRequest]:  # fmt: skip
    """``num_prefixes`` system prompts of ``prefix_tokens`` tokens (exact, in ``llm``'s tokenizer), each
    followed by ``per_prefix`` questions of its own of ``question_tokens`` tokens, in a seeded random order.
    (The prefix-aware policy keys on a prompt's first 256 characters: a system prompt shorter than that
    puts part of each question in the key, and its requests no longer meet on one replica.)"""
    count = lambda text: len(llm.tokenizer.encode(text))  # noqa: E731
    rng = random.Random(seed)
    prefixes = [f"# system prompt {p}\n" + sized_text(rng, prefix_tokens, count) for p in range(num_prefixes)]
    requests = [ChatRequest(p, prefix + "\n" + sized_text(rng, question_tokens, count))
                for p, prefix in enumerate(prefixes) for _ in range(per_prefix)]  # fmt: skip
    rng.shuffle(requests)
    return requests


def place(policy: str | RoutingPolicy, replicas: Sequence[str], prompts: Sequence[str]) -> list[str]:
    """The replica ``policy`` chooses for each prompt in turn, each answered before the next is placed."""
    chooser = make_routing_policy(policy)
    pool = [Replica(name) for name in replicas]
    return [chooser.choose(pool, {"prompt": prompt}).url for prompt in prompts]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def predicted_cached_tokens(
    prompt_ids: Sequence[Sequence[int]], placement: Sequence[str], block_size: int
) -> list[int]:
    """Prompt tokens each request finds cached, served one at a time into empty caches that never evict:
    the full blocks it shares with the longest-matching earlier prompt on its own replica, never its own last
    token (its logits are needed to sample)."""
    cached = []
    for i, (ids, replica) in enumerate(zip(prompt_ids, placement)):
        shared = max((_common_prefix(ids, prompt_ids[j]) for j in range(i) if placement[j] == replica), default=0)
        cached.append(min(shared, len(ids) - 1) // block_size * block_size)
    return cached


def routing_run(
    replicas: dict[str, LLM], requests: Sequence[ChatRequest], policies: Sequence[str], params: SamplingParams
) -> pd.DataFrame:
    """Each policy's placement of ``requests`` on ``replicas`` (name → engine), served one at a time.

    One row per policy and request: ``policy``, ``request``, ``prefix``, ``replica``, ``prompt tokens``,
    ``cached (predicted)`` and ``cached (measured)`` (the engine's ``num_cached_tokens``). Each policy's
    prompts start with a line naming it, so nothing one policy's run cached helps the next one's.
    """
    names = list(replicas)
    block_size = next(iter(replicas.values())).engine.config.scheduler.block_size
    rows = []
    for policy in policies:
        prompts = [f"# routed by {policy}\n{request.prompt}" for request in requests]
        placement = place(policy, names, prompts)
        prompt_ids = [replicas[name].engine.encode(prompt) for name, prompt in zip(placement, prompts)]
        predicted = predicted_cached_tokens(prompt_ids, placement, block_size)
        for i, (request, name, ids) in enumerate(zip(requests, placement, prompt_ids)):
            (output,) = replicas[name].generate([ids], params)
            rows.append({"policy": policy, "request": i, "prefix": request.prefix, "replica": name,
                         "prompt tokens": len(ids), "cached (predicted)": predicted[i],
                         "cached (measured)": output.num_cached_tokens})  # fmt: skip
    return pd.DataFrame(rows)


def routing_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per policy: requests per replica, prefixes served by more than one replica, prompt tokens computed
    (not found cached), and the prefix-cache hit rate predicted and measured (cached over prompt tokens)."""
    table = {}
    for policy, run in rows.groupby("policy", sort=False):
        per_replica = run.groupby("replica")["request"].count()
        table[policy] = {
            "requests per replica": " / ".join(str(n) for n in per_replica),
            "prefixes on 2+ replicas": int((run.groupby("prefix")["replica"].nunique() > 1).sum()),
            "tokens computed": int(run["prompt tokens"].sum() - run["cached (measured)"].sum()),
            "hit rate (predicted)": run["cached (predicted)"].sum() / run["prompt tokens"].sum(),
            "hit rate (measured)": run["cached (measured)"].sum() / run["prompt tokens"].sum(),
        }
    return pd.DataFrame.from_dict(table, orient="index").rename_axis("policy")


def moved_on_loss(keys: Sequence[str], replicas: Sequence[str], lost: str) -> pd.DataFrame:
    """How many of ``keys`` change replica when ``lost`` leaves, under rendezvous hashing (the prefix-aware
    policy's) and under ``hash(key) mod n``: a moved key's cached prefix is cold on its new replica."""
    remaining = [name for name in replicas if name != lost]

    def modulo(key: str, names: Sequence[str]) -> str:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return names[int.from_bytes(digest, "big") % len(names)]

    def highest(key: str, names: Sequence[str]) -> str:
        return rendezvous(key, [Replica(name) for name in names]).url

    rows = []
    for scheme, choose in (("rendezvous", highest), ("hash mod n", modulo)):
        before = [choose(key, replicas) for key in keys]
        after = [choose(key, remaining) for key in keys]
        rows.append({"scheme": scheme, "keys": len(keys), f"on {lost}": before.count(lost),
                     "moved": sum(b != a for b, a in zip(before, after))})  # fmt: skip
    return pd.DataFrame(rows).set_index("scheme")


def router_benchmark_table(path: Path = ROUTER_RESULTS) -> tuple[pd.DataFrame, dict]:
    """What ``benchmarks/router.py`` recorded (two ``minserve serve`` replicas behind ``minserve route``): per
    policy, throughput, TTFT, requests per replica and the prefix-cache hit rate; and the run's settings."""
    recorded = json.loads(Path(path).read_text())
    rows = {
        row["policy"]: {
            "req/s": row["request_throughput_rps"],
            "output tok/s": row["output_throughput_tps"],
            "TTFT p50 ms": row["ttft_ms"]["p50"],
            "TTFT p99 ms": row["ttft_ms"]["p99"],
            "requests per replica": " / ".join(str(r["requests"]) for r in row["replicas"]),
            "hit rate": row["hit_rate"],
        }
        for row in recorded["rows"]
    }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("policy"), recorded["settings"]

"""Experiments on the simulator that the chapters run: workloads of a given shape, capacity, policy sweeps.

Each returns plain data (requests, numbers, rows); :mod:`minserve.lab.scheduling` draws them. Chapter 05
sweeps scheduling policies with them; chapter 09's capacity envelope builds on :func:`capacity_rps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from minserve import slo
from minserve.capacity.cost_model import StepCostModel
from minserve.capacity.simulator import SimRequest, SimResult, SimulatedRequest, Simulator, make_requests
from minserve.config import SchedulerConfig
from minserve.engine.policies import Policy
from minserve.workload import poisson_arrivals


def mixed_workload(
    num_requests: int,
    rate_rps: float,
    seed: int = 0,
    long_fraction: float = 0.2,
    short_prompt: tuple[int, int] = (16, 64),
    long_prompt: tuple[int, int] = (768, 1536),
    output: tuple[int, int] = (16, 64),
    vocab_size: int = 2048,
) -> list[SimRequest]:
    """Poisson arrivals of mostly short prompts and a ``long_fraction`` of long ones (uniform in the given
    inclusive ranges of tokens), outputs uniform in ``output``: the shape in which a first-come-first-served
    queue makes short requests wait behind long ones. Seeded: the same arguments give the same requests."""
    rng = np.random.default_rng(seed)
    is_long = rng.random(num_requests) < long_fraction
    prompts = np.where(
        is_long,
        rng.integers(long_prompt[0], long_prompt[1] + 1, num_requests),
        rng.integers(short_prompt[0], short_prompt[1] + 1, num_requests),
    )
    outputs = rng.integers(output[0], output[1] + 1, num_requests)
    arrivals = poisson_arrivals(num_requests, rate_rps, seed=seed)
    return make_requests(arrivals, prompts.tolist(), outputs.tolist(), vocab_size=vocab_size, seed=seed)


def capacity_rps(cost: StepCostModel, config: SchedulerConfig, requests: Sequence[SimRequest]) -> float:
    """Requests per second the simulated engine finishes when every request arrives at once."""
    at_once = [SimRequest(0.0, r.prompt_token_ids, r.output_tokens, r.priority, None, r.request_id) for r in requests]
    return Simulator(cost, config).run(at_once).summary()["request_throughput_rps"]


def class_summary(result: SimResult, long_threshold: int) -> dict[str, float]:
    """TTFT of the short and the long requests apart (prompt tokens below / at or above ``long_threshold``):
    ``ttft_short_p50_ms``, ``ttft_short_p99_ms``, ``ttft_long_p50_ms``, ``ttft_long_max_ms``."""
    ttfts = [(r.prompt_tokens >= long_threshold, r.record.ttft_s) for r in result.requests]
    short = [t for is_long, t in ttfts if not is_long and t is not None]
    long = [t for is_long, t in ttfts if is_long and t is not None]
    return {
        "ttft_short_p50_ms": slo.percentile(short, 50) * 1e3,
        "ttft_short_p99_ms": slo.percentile(short, 99) * 1e3,
        "ttft_long_p50_ms": slo.percentile(long, 50) * 1e3,
        "ttft_long_max_ms": max(long, default=math.nan) * 1e3,
    }


def policy_sweep(
    cost: StepCostModel,
    config: SchedulerConfig,
    workload: Callable[[float], Sequence[SimRequest]],
    policies: Mapping[str, str | Policy],
    rates_rps: Sequence[float],
    slo_target: slo.SLO,
    long_threshold: int = 512,
) -> list[dict[str, Any]]:
    """Simulate ``workload(rate)`` under every policy at every rate: one row per (policy, rate) with goodput,
    throughput, attainment, TTFT and TPOT percentiles, short and long requests' TTFT (:func:`class_summary`),
    steps, preemptions, and the seconds the simulation took (``sim_wall_s``). Every policy sees the same
    requests at a given rate."""
    rows = []
    for rate in rates_rps:
        requests = list(workload(rate))
        for label, policy in policies.items():
            result = Simulator(cost, config.replace(scheduling_policy=policy)).run(requests)
            summary = result.summary(slo_target)
            rows.append(
                {
                    "policy": label,
                    "rate_rps": rate,
                    **summary,
                    **class_summary(result, long_threshold),
                    "sim_wall_s": result.wall_s,
                }
            )
    return rows


def stream_with_long_request(
    rate_rps: float,
    duration_s: float,
    long_prompt_tokens: int,
    long_arrives_s: float,
    short_prompt: tuple[int, int] = (16, 64),
    output: tuple[int, int] = (16, 64),
    seed: int = 0,
    vocab_size: int = 2048,
) -> list[SimRequest]:
    """A steady Poisson stream of short requests for ``duration_s`` seconds and one long prompt, id ``"long"``,
    arriving at ``long_arrives_s`` among them: the starvation experiment."""
    rng = np.random.default_rng(seed)
    arrivals = [t for t in poisson_arrivals(int(rate_rps * duration_s) + 1, rate_rps, seed=seed) if t <= duration_s]
    n = len(arrivals)
    shorts = make_requests(
        arrivals,
        rng.integers(short_prompt[0], short_prompt[1] + 1, n).tolist(),
        rng.integers(output[0], output[1] + 1, n).tolist(),
        vocab_size=vocab_size,
        seed=seed,
    )
    (long,) = make_requests([long_arrives_s], long_prompt_tokens, output[1], vocab_size=vocab_size, seed=seed + 1)
    return sorted([*shorts, SimRequest(long.arrival_s, long.prompt_token_ids, long.output_tokens, request_id="long")],
                  key=lambda r: r.arrival_s)  # fmt: skip


def find_request(result: SimResult, request_id: str) -> SimulatedRequest:
    """The simulated request with this id (a :class:`~minserve.capacity.simulator.SimulatedRequest`)."""
    for request in result.requests:
        if request.request_id == request_id:
            return request
    raise KeyError(request_id)

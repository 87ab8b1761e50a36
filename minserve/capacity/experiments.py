"""Experiments on the simulator that the chapters run: workloads of a given shape, capacity, policy sweeps.

Each returns plain data (requests, numbers, rows); the lab draws them. Chapter 05 sweeps scheduling policies
(:func:`policy_sweep`); chapter 09 drives the simulated engine at one to three times its capacity with and
without admission control (:func:`overload_sweep`). Capacity here is :func:`capacity_rps`, what the engine
finishes when every request is queued at once; chapter 09's capacity envelope is a different, fuller
calculation (:mod:`minserve.capacity.planner`: KV-limited concurrency, the highest rate meeting the SLO, …).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from minserve import slo
from minserve.admission import AdmissionPolicy, DeadlineAware, QueueLength
from minserve.capacity.cost_model import StepCostModel
from minserve.capacity.simulator import SimRequest, SimResult, SimulatedRequest, Simulator, make_requests
from minserve.config import SchedulerConfig, ServerConfig
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


# --- chapter 09: admission control under overload ----------------------------------------------------------

# minserve-tiny on a 2-core CPU, one torch thread (benchmarks/results/simulator-validation-cpu-*.json), rounded:
# the engine chapter 09's server runs, so the simulated sweep and the measured one tell the same story (the
# chapter 05 and 09 graders simulate with it too).
TINY_CPU_COST = StepCostModel(
    {
        "base": 1.8e-3,
        "prefill_tokens": 6.0e-5,
        "prefill_attention_pairs": 1.6e-7,
        "decode_seqs": 1.3e-4,
        "decode_context_tokens": 2.6e-7,
        "decode_padded_kv_tokens": 1.0e-6,
    }
)
OVERLOAD_CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=2048, max_model_len=2048)
OVERLOAD_SLO = slo.SLO(name="interactive", ttft_s=1.0)
NO_ADMISSION = 10**9  # a queue-length limit no run reaches: every request is admitted
# DeadlineAware admits while the predicted TTFT is within its budget, so under overload the queue settles
# where the prediction equals the budget, and the admitted requests' TTFTs scatter around it: aimed at the
# SLO itself, about half of them miss. Aimed at half the SLO, the scatter stays inside it. The server's
# default, so the simulated policy is the one `minserve serve --admission deadline` runs.
ADMISSION_HEADROOM = ServerConfig().admission_headroom
OVERLOAD_COLUMNS = (
    "policy", "load_multiple", "offered_rps", "capacity_rps", "sent", "admitted", "refused", "timed_out",
    "met_slo", "ttft_p50_s", "ttft_p99_s", "attainment_admitted", "attainment_all", "goodput_rps",
    "refusal_share",
)  # fmt: skip


def overload_workload(num_requests: int, rate_rps: float, seed: int = 0) -> list[SimRequest]:
    """Chapter 09's workload: Poisson arrivals, prompts of 32–256 tokens, outputs of 16–64 (uniform). Its
    lengths do not depend on the rate, so every load of a sweep sends the same requests, closer together."""
    return mixed_workload(num_requests, rate_rps, seed, long_fraction=0.0, short_prompt=(32, 256), output=(16, 64))


def overload_policies(
    slo_target: slo.SLO = OVERLOAD_SLO, headroom: float = ADMISSION_HEADROOM
) -> dict[str, AdmissionPolicy]:
    """The two sides of chapter 09's experiment: no admission (a queue limit never reached) and deadline-aware
    admission aiming at ``headroom`` × the SLO's TTFT (:data:`ADMISSION_HEADROOM` says why not all of it)."""
    if slo_target.ttft_s is None:
        raise ValueError(f"SLO {slo_target.name!r} has no ttft_s: deadline-aware admission needs a TTFT target")
    return {"no admission": QueueLength(NO_ADMISSION), "deadline-aware": DeadlineAware(slo_target.ttft_s, headroom)}


def overload_sweep(
    cost: StepCostModel = TINY_CPU_COST,
    config: SchedulerConfig = OVERLOAD_CONFIG,
    policies: Mapping[str, AdmissionPolicy | None] | None = None,
    load_multiples: Sequence[float] = (1.0, 2.0, 3.0),
    slo_target: slo.SLO = OVERLOAD_SLO,
    num_requests: int = 400,
    seed: int = 0,
    workload: Callable[[int, float, int], Sequence[SimRequest]] = overload_workload,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Simulate ``workload(num_requests, rate, seed)`` at each multiple of the engine's capacity under each
    admission policy (default :func:`overload_policies`; None: no policy at all): one row per (policy, load)
    with the columns of :data:`OVERLOAD_COLUMNS`.

    Capacity is :func:`capacity_rps` of the same requests. Every policy sees the same requests at a load.
    ``timeout_s``: every request's own timeout (its deadline in the engine, and deadline-aware admission's
    budget where it is shorter than the SLO); ``timed_out`` counts those stopped at it. The TTFT percentiles
    (``ttft_p50_s``, ``ttft_p99_s``, seconds) are of the admitted requests that got a first token;
    ``attainment_admitted`` is the share of admitted requests meeting ``slo_target``, ``attainment_all``
    the share of all sent; ``goodput_rps`` is :func:`minserve.slo.goodput_rps` (a refused request counts
    against it, as a failed one).
    """
    policies = overload_policies(slo_target) if policies is None else policies
    capacity = capacity_rps(cost, config, workload(num_requests, 1.0, seed))
    rows = []
    for multiple in load_multiples:
        offered = multiple * capacity
        requests = [_with_timeout(r, timeout_s) for r in workload(num_requests, offered, seed)]
        for label, policy in policies.items():
            result = Simulator(cost, config, admission=policy).run(requests)
            labels = {"policy": label, "load_multiple": multiple, "offered_rps": offered, "capacity_rps": capacity}
            rows.append(_overload_row(result, slo_target) | labels)
    return [{column: row[column] for column in OVERLOAD_COLUMNS} for row in rows]


def _with_timeout(request: SimRequest, timeout_s: float | None) -> SimRequest:
    if timeout_s is None:
        return request
    return SimRequest(request.arrival_s, request.prompt_token_ids, request.output_tokens, request.priority,
                      timeout_s, request.request_id)  # fmt: skip


def _overload_row(result: SimResult, slo_target: slo.SLO) -> dict[str, Any]:
    """The counts and rates of one overload run (every column but the run's labels)."""
    sent, refused = len(result.requests), len(result.refused)
    admitted = sent - refused
    records = result.records
    met = sum(slo.meets(record, slo_target)["all"] for record in records)
    ttfts = [t for t in (r.record.ttft_s for r in result.admitted) if t is not None]
    return {
        "sent": sent,
        "admitted": admitted,
        "refused": refused,
        "timed_out": sum(r.finish_reason == "deadline" for r in result.requests),
        "met_slo": met,
        "ttft_p50_s": slo.percentile(ttfts, 50),
        "ttft_p99_s": slo.percentile(ttfts, 99),
        "attainment_admitted": met / admitted if admitted else math.nan,
        "attainment_all": met / sent if sent else math.nan,
        "goodput_rps": slo.goodput_rps(records, slo_target),
        "refusal_share": refused / sent if sent else math.nan,
    }

"""Chapter 09: the capacity envelope of one replica, steps 4 to 6, and the plan for a target load.

:mod:`minserve.capacity.planner` finds the first three numbers (how many sequences at once, how fast a full
batch goes, the highest rate that meets the SLO); this module adds what follows from them: Little's law at
that rate, the queue limit it implies, and for a target rate the replicas and their cost. :func:`plan_capacity`
runs all six and returns the :class:`Envelope`.

Times are seconds (``_s``) unless a name says ``_ms``; rates requests per second (``_rps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minserve import slo
from minserve.capacity.planner import (
    DEFAULT_REL_TOL,
    SHORT_RUN_BATCHES,
    Machine,
    RateProbe,
    RateSearch,
    Throughput,
    Workload,
    budget_limited_concurrency,
    cached_prefix_tokens,
    kv_limited_concurrency,
    max_rate_meeting_slo,
    saturated_throughput,
)
from minserve.workload import LengthDist


def concurrency_limits(machine: Machine, workload: Workload) -> dict[str, int]:
    """What bounds the batch: ``kv`` (:func:`kv_limited_concurrency` at the mean lengths, rounded up),
    ``max_num_seqs``, and ``token budget`` (:func:`budget_limited_concurrency`)."""
    prompt, output = math.ceil(workload.mean_prompt_tokens), math.ceil(workload.mean_output_tokens)
    cached = cached_prefix_tokens(machine.config, prompt, workload.shared_prefix_tokens)
    return {
        "kv": kv_limited_concurrency(machine.config, prompt, output, workload.shared_prefix_tokens),
        "max_num_seqs": machine.config.max_num_seqs,
        "token budget": budget_limited_concurrency(machine.config, prompt, output, cached),
    }


def littles_law_in_flight(rate_rps: float, mean_time_s: float) -> float:
    """Little's law: the mean number in a system is its arrival rate times the mean time each spends in it,
    ``L = λ × W`` (requests). True of any stable system, whatever the distributions."""
    if rate_rps < 0 or mean_time_s < 0:
        raise ValueError(f"need rate and time ≥ 0, got {rate_rps} and {mean_time_s}")
    return rate_rps * mean_time_s


def replicas_for(target_rps: float, max_rate_per_replica_rps: float) -> int:
    """Replicas that serve ``target_rps`` within the SLO: ``⌈target ÷ the rate one replica can take⌉``."""
    if not target_rps > 0:
        raise ValueError(f"the target rate must be > 0 requests/s, got {target_rps}")
    if not max_rate_per_replica_rps > 0:
        raise ValueError("no rate meets the SLO on one replica, so no number of replicas will: relax the SLO, "
                         "shorten the requests or use a faster machine")  # fmt: skip
    return math.ceil(round(target_rps / max_rate_per_replica_rps, 9))  # 20 / (20 / 3) is 3, not 3.0000000001


@dataclass(frozen=True)
class Deployment:
    """Replicas for a target rate, and what they cost: US dollars per hour for all of them, and per million
    output tokens at the target rate (:func:`minserve.slo.cost_per_million_tokens`)."""

    target_rate_rps: float
    replicas: int
    usd_per_hour: float | None = None
    usd_per_million_output_tokens: float | None = None


def deployment(
    target_rps: float, max_rate_rps: float, mean_output_tokens: float, usd_per_replica_hour: float | None = None
) -> Deployment:
    """:func:`replicas_for` the target, priced at ``usd_per_replica_hour`` when given."""
    replicas = replicas_for(target_rps, max_rate_rps)
    if usd_per_replica_hour is None:
        return Deployment(target_rps, replicas)
    tokens_per_s = target_rps * mean_output_tokens
    per_million = slo.cost_per_million_tokens(usd_per_replica_hour, tokens_per_s, replicas)
    return Deployment(target_rps, replicas, usd_per_replica_hour * replicas, per_million)


@dataclass(frozen=True)
class Envelope:
    """One replica's capacity envelope for a workload and an SLO (the module's six numbers), and optionally
    what a target rate needs. Built by :func:`plan_capacity`; :meth:`rows` is its table."""

    machine: Machine
    workload: Workload
    slo_target: slo.SLO
    required_attainment: float
    concurrency_limits: dict[str, int]
    throughput: Throughput  # the ceiling
    max_rate_rps: float
    probes: tuple[RateProbe, ...]
    rel_tol: float = DEFAULT_REL_TOL
    deployment: Deployment | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def kv_limited_concurrency_seqs(self) -> int:
        return self.concurrency_limits["kv"]

    @property
    def binding_limit(self) -> str:
        """Which of :attr:`concurrency_limits` sets the batch."""
        return min(self.concurrency_limits, key=self.concurrency_limits.__getitem__)

    @property
    def at_max_rate(self) -> RateProbe | None:
        return RateSearch(self.max_rate_rps, self.probes).at_max_rate

    @property
    def in_flight_requests(self) -> float:
        """Little's law at the highest rate: ``λ × mean E2E`` (0 when no rate meets the SLO)."""
        probe = self.at_max_rate
        return littles_law_in_flight(self.max_rate_rps, probe.mean_e2e_s) if probe else 0.0

    @property
    def mean_queue_requests(self) -> float:
        """Little's law on the queue alone: ``λ × mean time before the first step``."""
        probe = self.at_max_rate
        return littles_law_in_flight(self.max_rate_rps, probe.mean_queue_s) if probe else 0.0

    @property
    def queue_limit_requests(self) -> int:
        """The queue arrivals find at the SLO's percentile at the highest rate, rounded up (module docstring, 5)."""
        probe = self.at_max_rate
        return math.ceil(probe.queue_found_requests) if probe else 0

    def header(self) -> list[str]:
        """What the envelope is of: the machine, the workload and the SLO, a line each."""
        workload, config = self.workload, self.machine.config
        chunked = "on" if config.enable_chunked_prefill else "off"
        policy = getattr(config.scheduling_policy, "name", config.scheduling_policy)
        prefix = f", every prompt starting with the same {workload.shared_prefix_tokens} tokens"
        return [
            f"{self.machine.name}; policy {policy}, {config.max_num_batched_tokens} tokens a step, chunked prefill "
            f"{chunked}",
            f"workload: prompts {length_text(workload.prompt_len)} (mean {workload.mean_prompt_tokens:.1f} tokens), "
            f"outputs {length_text(workload.output_len)} (mean {workload.mean_output_tokens:.1f})"
            f"{prefix if workload.shared_prefix_tokens else ''}; {workload.arrival} arrivals, "
            f"{workload.num_requests} requests a run",
            f"SLO: {slo_text(self.slo_target)} for at least {self.required_attainment:.4g} of requests",
        ]

    def rows(self) -> list[dict[str, str]]:
        """The envelope as a table: one row per quantity, its ``value`` with units and ``how`` it was found.
        (:attr:`notes` say what to read it with.)"""
        config, limits, ceiling = self.machine.config, self.concurrency_limits, self.throughput
        percent = f"{100 * self.required_attainment:g}"
        length = f"{math.ceil(self.workload.mean_prompt_tokens)} + {math.ceil(self.workload.mean_output_tokens)}"
        rows = [
            ("KV cache", f"{config.num_kv_blocks:,} blocks × {config.block_size} tokens",
             "calibrated engine's, or what fits beside the weights"),
            ("KV-limited concurrency", _count(limits["kv"], "sequence"),
             f"blocks ÷ blocks per sequence of {length} tokens, at its end"),
            ("batch limit", _count(min(limits.values()), "sequence"),
             f"smallest of KV {limits['kv']:,}, max_num_seqs {limits['max_num_seqs']:,}, "
             f"token budget {limits['token budget']:,}: {self.binding_limit} binds"),
            ("sustainable throughput", f"{ceiling.output_tokens_per_s:,.0f} output tokens/s = "
             f"{ceiling.requests_per_s:.3g} requests/s",
             "simulator, all requests at once, while the queue never empties: the ceiling"),
            ("  mean batch, mean step", f"{ceiling.concurrency_seqs:.3g} sequences, {ceiling.mean_step_s * 1e3:.3g} ms",
             "over the same stretch"),
        ]  # fmt: skip
        probe = self.at_max_rate
        if probe is None:
            rows.append(("max rate meeting the SLO", "none",
                         f"the SLO is missed at {self.probes[0].rate_rps:.3g} requests/s, a light load"))  # fmt: skip
        else:
            rows += [
                ("max rate meeting the SLO", f"{self.max_rate_rps:.3g} requests/s "
                 f"({self.max_rate_rps / ceiling.requests_per_s:.0%} of the ceiling)",
                 f"simulator, bisection to {self.rel_tol:.0%}, {len(self.probes)} runs of "
                 f"{self.workload.num_requests} requests"),
                (f"  at it: attainment, p{percent} TTFT, p{percent} TPOT",
                 f"{probe.attainment['all']:.1%}, {probe.ttft_ms:,.0f} ms, {probe.tpot_ms:.3g} ms",
                 f"SLO: {slo_text(self.slo_target)} for ≥ {percent}% of requests"),
                ("in flight (Little's law)", f"{self.in_flight_requests:.3g} requests",
                 f"rate × mean E2E {probe.mean_e2e_s * 1e3:,.0f} ms"),
                ("  waiting (Little's law)", f"{self.mean_queue_requests:.3g} requests",
                 f"rate × mean queue time {probe.mean_queue_s * 1e3:,.0f} ms"),
                ("queue limit", _count(self.queue_limit_requests, "request"),
                 f"p{percent} of the queue arrivals find at the max rate: --max-waiting-requests"),
            ]  # fmt: skip
        deploy = self.deployment
        if deploy is not None:
            rows.append(("replicas for the target", f"{deploy.replicas:,} for {deploy.target_rate_rps:g} requests/s",
                         "⌈target ÷ max rate⌉"))  # fmt: skip
            if deploy.usd_per_hour is not None:
                rows += [
                    ("cost per hour", f"${deploy.usd_per_hour:,.2f}", "replicas × $ per replica-hour"),
                    ("cost per million output tokens", f"${deploy.usd_per_million_output_tokens:,.3f}",
                     "at the target rate"),
                ]  # fmt: skip
        return [{"quantity": q, "value": v, "how": h} for q, v, h in rows]


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def slo_text(target: slo.SLO) -> str:
    """``"TTFT ≤ 500 ms, TPOT ≤ 100 ms"``: an SLO's targets, for a title or a table."""
    return ", ".join(f"{key.upper()} ≤ {value * 1e3:g} ms" for key, value in target.targets().items())


def length_text(dist: LengthDist) -> str:
    """A length distribution as :func:`minserve.workload.parse_length` reads it: ``"lognormal:256:128"``."""
    return f"{dist.mean:g}" if dist.kind == "fixed" else f"{dist.kind}:{dist.mean:g}:{dist.spread:g}"


def plan_capacity(
    machine: Machine,
    workload: Workload,
    slo_target: slo.SLO,
    required_attainment: float = 0.99,
    target_rate_rps: float | None = None,
    usd_per_replica_hour: float | None = None,
    rel_tol: float = DEFAULT_REL_TOL,
) -> Envelope:
    """The capacity envelope of one ``machine`` for ``workload`` under ``slo_target`` (met by at least
    ``required_attainment`` of requests), and with ``target_rate_rps`` the replicas and cost it needs."""
    if not slo_target.targets():
        raise ValueError("the SLO sets no target: give a TTFT or TPOT bound (or both)")
    limits = concurrency_limits(machine, workload)
    notes = []
    if limits["kv"] < 1:
        notes.append("one sequence of the mean length does not fit the KV cache: requests will be preempted")
    ceiling = saturated_throughput(machine, workload)
    search = max_rate_meeting_slo(machine, workload, slo_target, required_attainment, ceiling.requests_per_s, rel_tol)
    if search.max_rate_rps * (1 + rel_tol) ** 2 >= ceiling.requests_per_s:
        notes.append("the SLO holds up to the throughput ceiling: throughput binds, not latency; a replica that busy "
                     "has no headroom for a burst")  # fmt: skip
    if workload.num_requests < SHORT_RUN_BATCHES * ceiling.concurrency_seqs:
        notes.append(f"runs of {workload.num_requests} requests are short against a batch of "
                     f"{ceiling.concurrency_seqs:.0f}: the first requests find the replica empty, so the knee is "
                     f"optimistic; simulate at least {SHORT_RUN_BATCHES}× the batch (--num-prompts)")  # fmt: skip
    deploy = None
    if target_rate_rps is not None and search.max_rate_rps > 0:
        deploy = deployment(target_rate_rps, search.max_rate_rps, workload.mean_output_tokens, usd_per_replica_hour)
    elif target_rate_rps is not None:
        notes.append("no number of replicas meets the SLO: it is missed even at a light load")
    return Envelope(machine, workload, slo_target, required_attainment, limits, ceiling, search.max_rate_rps,
                    search.probes, rel_tol, deploy, tuple(notes))  # fmt: skip

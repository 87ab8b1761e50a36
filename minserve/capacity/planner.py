"""Chapter 09: the capacity envelope of one replica, and what a target load needs.

For a machine (a step-cost model calibrated here, or a GPU's roofline), a workload (arrival process, prompt
and output lengths, a shared prefix) and an SLO (TTFT and TPOT bounds that a share of requests must meet),
the envelope is six numbers, each from the one before:

1. **KV-limited concurrency**: how many sequences of the workload's length the KV blocks hold at once, at
   their full length, so that none is preempted: ``(blocks − shared prefix blocks) ÷ blocks a sequence owns``
   (:func:`kv_limited_concurrency`, block arithmetic from :mod:`minserve.capacity.kv`). The batch is the
   smallest of that, ``max_num_seqs`` and what the token budget allows.
2. **Sustainable throughput**: the simulator with every request arriving at once, so the batch stays as full
   as those limits allow, counted while the queue is never empty (:func:`saturated_throughput`). A ceiling:
   past it, the queue grows without end whatever the SLO.
3. **The highest arrival rate that meets the SLO**: found by bisection on the simulator, the engine's own
   scheduler on a virtual clock (:func:`max_rate_meeting_slo`). It sits below the ceiling: requests arrive
   at random, queues form before the batch is full, and a request that waits misses its TTFT.
4. **Little's law** at that rate: requests in flight ``L = λ × W`` (``W`` the mean end-to-end latency), and
   in the queue ``λ × W_queue``.
5. **The queue limit it implies**: the length of queue that arriving requests find, at the SLO's percentile,
   at that rate (:func:`queue_found_on_arrival`). A server that refuses requests past it
   (``--max-waiting-requests``) turns away about ``1 − attainment`` of them at the highest rate and, past it,
   refuses the excess at once instead of letting the queue (and every TTFT behind it) grow without end. Why
   not Little's mean queue: queues fluctuate, and a limit set at the mean would refuse requests that would
   have met their SLO. Why not "in flight minus the KV-limited concurrency": below the knee the batch is
   rarely full, so that difference is usually negative.
6. **For a target rate**: ``replicas = ⌈target ÷ max rate per replica⌉`` and their cost per hour and per
   million output tokens (:func:`minserve.slo.cost_per_million_tokens`).

Steps 1 to 3 are here; steps 4 to 6, and :func:`~minserve.capacity.envelope.plan_capacity` that runs all six,
are in :mod:`minserve.capacity.envelope`.

**Noise.** Each probe of the bisection simulates the same requests (``Workload.requests``: the same lengths
and prompts, and arrival gaps drawn from one seed and scaled by 1/rate: common random numbers), so
attainment falls with the rate almost monotonically, and the bisection stops when the bracket is within
``rel_tol`` (2%) of the rate. A finite run flatters the knee (:mod:`minserve.capacity.queueing`): its first
requests find the replica empty, and past capacity the backlog has only as long as the run to grow. So the
search stays below the ceiling, and the envelope says so when a run holds fewer than four batches of
requests; simulate as many requests as the load test that will confirm it sends.

Times are seconds (``_s``) unless a name says ``_ms``; rates requests per second (``_rps``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from minserve import slo
from minserve.capacity.cost_model import StepCost, StepCostModel
from minserve.capacity.kv import Dtype, ModelLike, blocks_per_sequence, kv_bytes_per_token, model_config
from minserve.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION, fit
from minserve.capacity.roofline import Hardware
from minserve.capacity.roofline_cost import RooflineStepCost
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator, make_requests
from minserve.workload import ARRIVALS, LengthDist, request_lengths, timetable

DEFAULT_REL_TOL = 0.02  # the bisection's bracket, as a share of the rate
LIGHT_LOAD_SHARE = 1 / 32  # the bisection's lowest probe, as a share of the throughput ceiling
SHORT_RUN_BATCHES = 4  # a run of fewer requests than this many batches is short: its knee is optimistic


# --- what arrives, and what serves it ----------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What arrives: prompt and output lengths (tokens), a prefix every prompt starts with, and how requests
    arrive (an arrival process of :mod:`minserve.workload`: ``poisson``, ``gamma`` with a ``burstiness``, or
    ``constant``). ``num_requests`` is the length of each simulated run; ``seed`` fixes lengths, prompts
    and arrival gaps."""

    prompt_len: LengthDist
    output_len: LengthDist
    shared_prefix_tokens: int = 0
    num_requests: int = 500
    arrival: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"a workload needs at least 1 request, got {self.num_requests!r}")
        if self.shared_prefix_tokens < 0:
            raise ValueError(f"shared_prefix_tokens must be ≥ 0, got {self.shared_prefix_tokens}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.burstiness != 1.0 and self.arrival != "gamma":
            raise ValueError("burstiness applies to gamma arrivals only")

    @cached_property
    def lengths(self) -> tuple[tuple[int, int], ...]:
        """(prompt tokens, output tokens) of each request, in arrival order: the same at every rate."""
        return tuple(request_lengths(self.prompt_len, self.output_len, self.num_requests, self.seed))

    @property
    def mean_prompt_tokens(self) -> float:
        return float(np.mean([p for p, _ in self.lengths]))

    @property
    def mean_output_tokens(self) -> float:
        return float(np.mean([o for _, o in self.lengths]))

    def requests(self, rate_rps: float, vocab_size: int = 2048, prompt_seed_offset: int = 0) -> list[SimRequest]:
        """The run at ``rate_rps``: the same lengths at every rate, and arrival gaps drawn from one seed and
        scaled by 1/rate (common random numbers: two rates differ in the rate alone). ``prompt_seed_offset``
        draws other prompt token ids for the same run, for an engine whose prefix cache remembers the last
        one; the simulator's timing does not depend on them (no two prompts share a block beyond the prefix)."""
        arrivals = timetable(self.num_requests, rate_rps, self.arrival, self.burstiness, self.seed)
        prompts, outputs = (list(column) for column in zip(*self.lengths))
        seed, shared = self.seed + prompt_seed_offset, self.shared_prefix_tokens
        return make_requests(arrivals, prompts, outputs, vocab_size, seed, shared_prefix_tokens=shared)


@dataclass(frozen=True)
class Machine:
    """One replica: what its steps cost (a :class:`~minserve.capacity.cost_model.StepCost`) and the scheduler's
    settings, its KV blocks among them. ``vocab_size`` bounds the simulated prompts' token ids."""

    name: str
    cost: StepCost
    config: SchedulerConfig
    vocab_size: int = 2048


def calibrated_machine(cost: StepCostModel, **knobs: Any) -> Machine:
    """This machine as ``minserve plan calibrate`` measured it: the fitted cost model and the engine settings
    it was calibrated with (``knobs``, :class:`SchedulerConfig` fields, override them)."""
    info = cost.info
    config = SchedulerConfig.from_dict(info.get("engine", {}), **knobs)
    where = ", ".join(str(info[key]) for key in ("device", "dtype", "backend") if info.get(key))
    threads = f", {info['threads']} thread{'s' if info['threads'] != 1 else ''}" if info.get("threads") else ""
    return Machine(f"{info.get('model', 'a model')} on this machine ({where}{threads}, calibrated)", cost, config)


def kv_blocks_that_fit(
    model: ModelLike,
    memory_bytes: int,
    block_size_tokens: int = 16,
    dtype: Dtype = "bfloat16",
    kv_dtype: Dtype | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> int:
    """KV blocks an accelerator of ``memory_bytes`` holds beside the weights: what :func:`~minserve.capacity.memory.fit`
    leaves of the usable memory (``utilization ×`` memory − weights), in whole blocks. 0 when the weights do not fit."""
    config = model_config(model)
    room = fit(config, memory_bytes, block_size_tokens, 0, dtype, kv_dtype, block_size_tokens, gpu_memory_utilization)
    block_bytes = block_size_tokens * kv_bytes_per_token(config, kv_dtype or dtype)
    return max(room.headroom_bytes, 0) // block_bytes


def roofline_machine(
    model: ModelLike,
    hw: Hardware,
    dtype: Dtype | None = None,
    kv_dtype: Dtype | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    step_overhead_s: float = 0.0,
    **knobs: Any,
) -> Machine:
    """A GPU from the roofline's table: steps priced by :class:`RooflineStepCost`, and as many KV blocks as fit
    beside the weights (``knobs``, :class:`SchedulerConfig` fields, may set another ``num_kv_blocks``)."""
    config, dtype = model_config(model), dtype or hw.dtype
    block_size = knobs.get("block_size", SchedulerConfig.block_size)
    blocks = kv_blocks_that_fit(config, hw.memory_bytes, block_size, dtype, kv_dtype, gpu_memory_utilization)
    if blocks < 1 and "num_kv_blocks" not in knobs:
        raise ValueError(f"the weights leave no room for a KV cache on {hw.name}; use a larger GPU or fewer bytes "
                         "per weight (--dtype)")  # fmt: skip
    scheduler = SchedulerConfig(**{"num_kv_blocks": blocks, **knobs})
    cost = RooflineStepCost(config, hw, dtype, kv_dtype, step_overhead_s)
    return Machine(f"{hw.name} (roofline, {dtype})", cost, scheduler, config.vocab_size)


# --- 1. how many sequences at once --------------------------------------------------------------------------


def kv_tokens_per_sequence(prompt_tokens: int, output_tokens: int) -> int:
    """Tokens whose K/V a sequence holds at its end: its prompt and every output token but the last, which is
    sampled and returned, never fed back through the model."""
    return prompt_tokens + output_tokens - 1


def cached_prefix_tokens(config: SchedulerConfig, prompt_tokens: int, shared_prefix_tokens: int) -> int:
    """Prompt tokens a request finds in the prefix cache: the shared prefix's *full* blocks (only those are
    named), never the prompt's last token (its logits are needed); none with prefix caching off."""
    if not config.enable_prefix_caching:
        return 0
    shared = min(shared_prefix_tokens, prompt_tokens - 1)
    return shared // config.block_size * config.block_size


def kv_limited_concurrency(
    config: SchedulerConfig, prompt_tokens: int, output_tokens: int, shared_prefix_tokens: int = 0
) -> int:
    """Sequences of ``prompt_tokens`` + ``output_tokens`` that ``config``'s KV blocks hold at once at their full
    length (:func:`kv_tokens_per_sequence`), so that none is preempted. The shared prefix's cached blocks are
    held once for all; each sequence owns the blocks of the rest (:func:`~minserve.capacity.kv.blocks_per_sequence`)."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"need prompt and output lengths ≥ 1 token, got {prompt_tokens} and {output_tokens}")
    shared = cached_prefix_tokens(config, prompt_tokens, shared_prefix_tokens)
    own_blocks = blocks_per_sequence(kv_tokens_per_sequence(prompt_tokens, output_tokens) - shared, config.block_size)
    return max(config.num_kv_blocks - shared // config.block_size, 0) // own_blocks


def budget_limited_concurrency(
    config: SchedulerConfig, prompt_tokens: float, output_tokens: float, cached_tokens: float = 0.0
) -> int:
    """Sequences the per-step token budget keeps running: a seat is held ``output_tokens`` steps, one of them
    its prompt's, so a step of ``C`` seats carries ``C × (output − 1 + uncached prompt) / output`` tokens,
    at most ``max_num_batched_tokens``."""
    tokens_per_seat_step = (output_tokens - 1 + prompt_tokens - cached_tokens) / output_tokens
    return max(int(config.max_num_batched_tokens / tokens_per_seat_step), 1)


# --- 2. how fast a full batch goes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """What a saturated replica sustains: the mean batch (sequences running), the mean step, output tokens
    and requests per second. Measured over ``window_s`` seconds of a run in which the queue never emptied."""

    concurrency_seqs: float
    mean_step_s: float
    output_tokens_per_s: float
    requests_per_s: float
    window_s: float


def saturated_throughput(machine: Machine, workload: Workload) -> Throughput:
    """The throughput ceiling: the workload's requests all arriving at once on the simulated ``machine``, so the
    scheduler always has someone waiting and fills every seat the memory, ``max_num_seqs`` and the token
    budget allow. Counted from the first request's finish (the batch has been full for a whole request by
    then) to the last step that left someone waiting (after it the batch drains): the steady part of the run.
    Requests per second are the tokens per second over the mean output: counting the requests that finish in
    so short a stretch would count the shortest ones, since the batch started all together.

    Why simulate rather than divide the batch by a mean step: a step's cost is not linear in what it holds
    (the roofline's ``max`` of compute and memory; the torch backend's padding to the *longest* context), so
    the mean step's cost is not the cost of the mean step, by 30% and more for lognormal lengths.
    """
    result = Simulator(machine.cost, machine.config).run(workload.requests(math.inf, machine.vocab_size))
    first_finish_s = min(r.metrics.finish_time_s for r in result.requests)
    steady = [step for step in result.steps if step.num_waiting > 0 and step.start_s >= first_finish_s]
    if len(steady) < 2:  # too few requests to saturate for long: the whole run, its start and drain included
        steady = result.steps
    start_s, end_s = steady[0].start_s, steady[-1].start_s + steady[-1].duration_s
    window_s = end_s - start_s
    tokens_per_s = sum(start_s < t <= end_s for r in result.requests for t in r.metrics.token_times_s) / window_s
    running_s = sum((step.features.prefill_seqs + step.features.decode_seqs) * step.duration_s for step in steady)
    requests_per_s = tokens_per_s / workload.mean_output_tokens  # requests leave at the rate their tokens do
    return Throughput(running_s / window_s, window_s / len(steady), tokens_per_s, requests_per_s, window_s)


# --- 3. the highest rate that meets the SLO ----------------------------------------------------------------


class HasQueueTimes(Protocol):
    """What :func:`queue_found_on_arrival` reads of a request: the engine's
    :class:`~minserve.engine.outputs.RequestMetrics` has both."""

    arrival_time_s: float
    first_scheduled_time_s: float | None


def queue_found_on_arrival(metrics: Sequence[HasQueueTimes]) -> list[int]:
    """For each request, how many requests were waiting when it arrived: arrived before it and not yet
    scheduled (a request never scheduled waits to the end). That is the queue length an admission check on
    arrival compares with its limit. In the order given."""
    order = sorted(range(len(metrics)), key=lambda i: metrics[i].arrival_time_s)  # stable: ties keep order
    arrivals = np.array([metrics[i].arrival_time_s for i in order])
    scheduled = np.array([_scheduled_s(metrics[i]) for i in order])
    found = [0] * len(metrics)
    for rank, index in enumerate(order):
        found[index] = int(np.count_nonzero(scheduled[:rank] > arrivals[rank]))
    return found


def _scheduled_s(metrics: HasQueueTimes) -> float:
    return math.inf if metrics.first_scheduled_time_s is None else metrics.first_scheduled_time_s


def meets_slo(attainment: dict[str, float], required_attainment: float) -> bool:
    """The verdict the load tester gives (:func:`minserve.bench.metrics.verdict`'s latency part): at least
    ``required_attainment`` of all requests met every target. ``nan`` (no requests) does not."""
    return attainment["all"] >= required_attainment


@dataclass(frozen=True)
class RateProbe:
    """One run at one arrival rate, judged against the SLO. Latency percentiles are at the SLO's own
    (``100 × required_attainment``); ``queue_found_requests`` too (:func:`queue_found_on_arrival`)."""

    rate_rps: float
    attainment: dict[str, float]
    meets_slo: bool
    goodput_rps: float
    output_tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    mean_e2e_s: float
    mean_queue_s: float
    queue_found_requests: float
    preemptions: int = 0

    @classmethod
    def of(
        cls,
        rate_rps: float,
        records: Sequence[slo.RequestRecord],
        metrics: Sequence[HasQueueTimes],
        slo_target: slo.SLO,
        required_attainment: float,
        preemptions: int = 0,
    ) -> RateProbe:
        """Judge a run (its :mod:`minserve.slo` records and the engine's metrics, one each per request)."""
        percent = 100 * required_attainment
        attained = slo.attainment(records, slo_target)
        queue_s = [_scheduled_s(m) - m.arrival_time_s for m in metrics]
        return cls(
            rate_rps=rate_rps,
            attainment=attained,
            meets_slo=meets_slo(attained, required_attainment),
            goodput_rps=slo.goodput_rps(records, slo_target),
            output_tokens_per_s=slo.token_throughput_tps(records),
            ttft_ms=slo.percentile(slo.metric_values_s(records, "ttft"), percent) * 1e3,
            tpot_ms=slo.percentile(slo.metric_values_s(records, "tpot"), percent) * 1e3,
            mean_e2e_s=float(np.mean([r.e2e_s for r in records])),
            mean_queue_s=float(np.mean(queue_s)),
            queue_found_requests=slo.percentile(queue_found_on_arrival(metrics), percent),
            preemptions=preemptions,
        )


def probe_rate(
    machine: Machine, workload: Workload, slo_target: slo.SLO, required_attainment: float, rate_rps: float
) -> RateProbe:
    """Simulate ``workload`` at ``rate_rps`` on ``machine`` and judge it against the SLO."""
    result = Simulator(machine.cost, machine.config).run(workload.requests(rate_rps, machine.vocab_size))
    metrics = [r.metrics for r in result.requests]
    return RateProbe.of(rate_rps, result.records, metrics, slo_target, required_attainment, result.num_preemptions)


def bisect_max_rate(
    meets: Callable[[float], bool], low_rps: float, high_rps: float, rel_tol: float = DEFAULT_REL_TOL
) -> float:
    """The highest rate at which ``meets`` holds, given that it holds at ``low_rps`` and not at ``high_rps``:
    bisection (at the geometric mean, so the bracket shrinks by the same ratio whatever the scale) until
    ``high ≤ low × (1 + rel_tol)``. Returns the low end, a rate that met. Assumes one knee: ``meets`` true
    below it, false above."""
    if not 0 < low_rps < high_rps:
        raise ValueError(f"need 0 < low < high, got {low_rps} and {high_rps}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    low, high = low_rps, high_rps
    while high > low * (1 + rel_tol):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


@dataclass(frozen=True)
class RateSearch:
    """What :func:`max_rate_meeting_slo` found: the rate (0 when the SLO is missed even at a light load) and
    every probe it simulated, in the order it ran them."""

    max_rate_rps: float
    probes: tuple[RateProbe, ...]

    @property
    def at_max_rate(self) -> RateProbe | None:
        """The probe at the rate found (``None`` when none met)."""
        met = [p for p in self.probes if p.meets_slo and p.rate_rps == self.max_rate_rps]
        return met[-1] if met else None


def max_rate_meeting_slo(
    machine: Machine,
    workload: Workload,
    slo_target: slo.SLO,
    required_attainment: float = 0.99,
    ceiling_rps: float | None = None,
    rel_tol: float = DEFAULT_REL_TOL,
) -> RateSearch:
    """The highest arrival rate at which the simulated ``machine`` meets the SLO, by :func:`bisect_max_rate`
    between a light load and the throughput ceiling (``ceiling_rps``; default :func:`saturated_throughput`).

    A light load, 1/32 of the ceiling, must meet the SLO, or none does (a lone request misses it) and the
    answer is 0. The ceiling itself is taken to miss it, unprobed: there the replica is busy all the time and
    its queue, in a long enough run, grows without end, however a finite run comes out (its backlog has only
    as long as the run to grow). So the answer is below the ceiling, within ``rel_tol`` of it when the SLO
    never binds first.
    """
    if not 0 < required_attainment <= 1:
        raise ValueError(f"required attainment must be in (0, 1], got {required_attainment}")
    probes: list[RateProbe] = []

    def meets(rate_rps: float) -> bool:
        probes.append(probe_rate(machine, workload, slo_target, required_attainment, rate_rps))
        return probes[-1].meets_slo

    ceiling = ceiling_rps if ceiling_rps is not None else saturated_throughput(machine, workload).requests_per_s
    low = ceiling * LIGHT_LOAD_SHARE
    if not meets(low):
        return RateSearch(0.0, tuple(probes))
    return RateSearch(bisect_max_rate(meets, low, ceiling, rel_tol), tuple(probes))

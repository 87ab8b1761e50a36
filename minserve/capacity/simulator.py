"""A discrete-event simulator of the engine: the engine's own core on a virtual clock.

The engine core (:mod:`minserve.engine.core`) holds every rule of a step: admission, chunking, preemption,
every policy, deadlines, the length stop, waiting time. It runs here unchanged, with two parts swapped: its
executor is a :class:`~minserve.capacity.cost_model.CostModelExecutor`, which runs no model and moves a
:class:`~minserve.engine.clocks.VirtualClock` forward by what each step costs, and the clock is that virtual
clock, which jumps over idle time to the next arrival. A rule written once therefore holds in both by
construction. A thousand requests take seconds, so a chapter can sweep policies and arrival rates that
would take the engine minutes.

Each request comes out with the engine's :class:`~minserve.engine.outputs.RequestMetrics` (arrival, first
scheduled, every token's time, finish, time spent waiting) and as a :class:`minserve.slo.RequestRecord`, so
the same SLO code summarizes a simulation and a measured run (:func:`minserve.slo.summarize`).

With an admission policy (:mod:`minserve.admission`, the server's own), each request is decided at
its arrival from the :class:`~minserve.admission.QueueState` the server would see: the core's counts
and the service rates a :class:`~minserve.engine.service_rates.ServiceRateMeter` measures from the simulated
steps, the same meter the engine core process runs. A refused request never reaches the core; it comes out
with its :class:`~minserve.admission.Refusal`, no tokens, and counts as failed, so it never meets an SLO.

What the simulator does not model: sampling and stop strings (every request produces exactly its output
length, as with ``ignore_eos``), cancellations, and time spent outside ``engine.step()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minserve import slo
from minserve.admission import AdmissionPolicy, QueueState, Refusal, RequestFacts
from minserve.capacity.cost_model import CostModelExecutor, StepCost, StepCostModel, StepFeatures
from minserve.config import SchedulerConfig
from minserve.engine.block_manager import BlockManager
from minserve.engine.clocks import VirtualClock
from minserve.engine.core import EngineCore
from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.driver import Arrival, drive
from minserve.engine.input_processor import check_fits
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.scheduler import Scheduler
from minserve.engine.sequence import Sequence as EngineSequence
from minserve.engine.service_rates import ServiceRateMeter
from minserve.engine.step_report import StepReport
from minserve.measure.prompts import random_prompts

# --- configuration and requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SimRequest:
    """One request for the simulator: when it arrives (seconds on the virtual clock), its prompt's token ids,
    how many tokens it produces, and the engine's per-request options (``deadline_s``: seconds after arrival).
    :func:`make_requests` builds them from lengths alone."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    priority: int = 0
    deadline_s: float | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise ValueError(f"output_tokens must be an integer ≥ 1, got {self.output_tokens!r}")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number ≥ 0, got {self.arrival_s!r}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be a positive number of seconds, got {self.deadline_s!r}")

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def make_requests(
    arrivals_s: Sequence[float],
    prompt_lengths: Sequence[int] | int,
    output_lengths: Sequence[int] | int,
    vocab_size: int = 2048,
    seed: int = 0,
    priorities: Sequence[int] | None = None,
    deadlines_s: Sequence[float | None] | float | None = None,
    shared_prefix_tokens: int = 0,
) -> list[SimRequest]:
    """Requests with seeded random prompts (:func:`minserve.measure.prompts.random_prompts`: token ids in
    ``[1, vocab_size)``, so no two share a cached block unless ``shared_prefix_tokens`` gives them all the same
    first tokens). Lengths are one per request or one for all."""
    n = len(arrivals_s)
    prompts_n = _per_request(prompt_lengths, n, "prompt_lengths")
    outputs_n = _per_request(output_lengths, n, "output_lengths")
    priorities = _per_request(priorities if priorities is not None else 0, n, "priorities")
    deadlines = _per_request(deadlines_s, n, "deadlines_s")
    prompts = random_prompts(prompts_n, vocab_size, seed, shared_prefix_tokens)
    return [SimRequest(arrivals_s[i], tuple(prompts[i]), outputs_n[i], priorities[i], deadlines[i], str(i))
            for i in range(n)]  # fmt: skip


def _per_request(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} requests")
        return list(value)
    return [value] * n


# --- results ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatedRequest:
    """One request after the simulation: its timestamps (the engine's :class:`RequestMetrics`) and how it ended."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    # "length" (produced what it asked for, or reached max_model_len), "deadline", or "refused" (admission)
    finish_reason: str
    metrics: RequestMetrics
    num_preemptions: int
    num_cached_tokens: int
    priority: int = 0
    refusal: Refusal | None = None  # why admission turned it away at its arrival (None: admitted)

    @property
    def record(self) -> slo.RequestRecord:
        status = "ok" if self.finish_reason == "length" else "failed"
        return slo.record_from_metrics(self.metrics, status, self.prompt_tokens, self.request_id)


@dataclass(frozen=True)
class StepRecord:
    """One simulated step: when it began on the virtual clock, how long it took, and what it ran."""

    start_s: float
    duration_s: float
    features: StepFeatures
    num_running: int  # after this step's scheduling
    num_waiting: int  # waiting or swapped out, after this step's scheduling
    num_preempted: int  # by this step's scheduling


@dataclass
class SimResult:
    """A finished simulation: every request, every step, and the totals."""

    requests: list[SimulatedRequest]
    steps: list[StepRecord]
    config: SchedulerConfig
    num_preemptions: int
    end_s: float  # the virtual clock when the last request finished
    wall_s: float  # real seconds the simulation took

    @property
    def records(self) -> list[slo.RequestRecord]:
        """Every request as :mod:`minserve.slo` sees it (a request stopped at its deadline, or refused by
        admission, is ``failed``: it never meets an SLO, and counts against goodput)."""
        return [r.record for r in self.requests]

    @property
    def refused(self) -> list[SimulatedRequest]:
        """The requests admission refused at their arrival, in arrival order (each with its ``refusal``)."""
        return [r for r in self.requests if r.refusal is not None]

    @property
    def admitted(self) -> list[SimulatedRequest]:
        """The requests admission let into the engine (all of them, without an admission policy)."""
        return [r for r in self.requests if r.refusal is None]

    def summary(self, slo_target: slo.SLO | None = None) -> dict[str, Any]:
        """:func:`minserve.slo.summarize` of the records (refused requests among the ``failed``), plus the
        refused count, steps and preemptions."""
        return slo.summarize(self.records, slo_target) | {
            "refused": len(self.refused),
            "steps": len(self.steps),
            "preemptions": self.num_preemptions,
            "virtual_s": self.end_s,
            "wall_s": self.wall_s,
        }


# --- the simulator ---------------------------------------------------------------------------------------


class _NoText:
    """A tokenizer that decodes nothing: the simulator never detokenizes."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


StepCallback = Callable[[StepRecord, StepReport], None]


class Simulator:
    """Runs requests through the engine core (the real :class:`Scheduler` and :class:`BlockManager`) on a
    virtual clock.

    >>> cost = StepCostModel({"base": 0.01, "prefill_tokens": 0.001, "decode_seqs": 0.002})
    >>> result = Simulator(cost).run([SimRequest(0.0, tuple(range(1, 101)), output_tokens=3)])
    >>> r = result.records[0]
    >>> round(r.ttft_s, 6), round(r.tpot_s, 6)   # prefill step 0.01 + 100 × 0.001; decode step 0.01 + 0.002
    (0.11, 0.012)

    Each :meth:`run` builds a fresh core, so runs are independent, and returns the requests in arrival
    order. ``on_step`` is called after every step with its :class:`StepRecord` and the core's
    :class:`~minserve.engine.step_report.StepReport`. ``admission``: the server's admission policy, deciding each
    request at its arrival (None: every request is admitted).
    """

    def __init__(
        self,
        cost_model: StepCost,
        config: SchedulerConfig | None = None,
        next_token: int = 0,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.cost_model = cost_model
        self.config = config or SchedulerConfig()
        self.next_token = next_token  # the token every step "samples": its value matters only to block hashes
        self.admission = admission
        self.core: EngineCore | None = None  # the last run's, for inspection
        self.meter: ServiceRateMeter | None = None  # the last run's measured rates (with an admission policy)

    @property
    def block_manager(self) -> BlockManager | None:
        return None if self.core is None else self.core.block_manager

    @property
    def scheduler(self) -> Scheduler | None:
        return None if self.core is None else self.core.scheduler

    def run(self, requests: Iterable[SimRequest], on_step: StepCallback | None = None) -> SimResult:
        wall_start = time.perf_counter()
        pending = sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep their given order
        clock = VirtualClock(pending[0].arrival_s if pending else 0.0)
        executor = CostModelExecutor(self.cost_model, clock, self.next_token)
        self.core = core = EngineCore(self.config, executor, clock)
        sequences = [self._sequence(request, index) for index, request in enumerate(pending)]
        for seq in sequences:  # refuse what can never run before anything does, as the engine would
            check_fits(len(seq.prompt_token_ids), seq.params.max_tokens, core.max_model_len,
                       self.config.kv_capacity_tokens)  # fmt: skip
        steps: list[StepRecord] = []

        def record(report: StepReport) -> None:
            features = StepFeatures.of_scheduled(report.scheduled, report.num_swapped_blocks)
            waiting = len(report.waiting) + len(report.swapped)
            step = StepRecord(report.start_s, report.duration_s, features, report.num_running, waiting,
                              len(report.preempted))  # fmt: skip
            steps.append(step)
            if on_step is not None:
                on_step(step, report)

        core.observers.append(record)
        refusals: dict[str, Refusal] = {}
        if self.admission is None:
            arrivals = [Arrival(seq.metrics.arrival_time_s, _adder(core, seq)) for seq in sequences]
        else:
            self.meter = ServiceRateMeter()  # the engine core process's observer, fed the simulated steps
            core.observers.append(self.meter)
            arrivals = [Arrival(seq.metrics.arrival_time_s, self._gate(seq, request, refusals))
                        for seq, request in zip(sequences, pending)]  # fmt: skip
        finished = drive(core, arrivals, start_s=0.0)
        results = [
            self._refused(request, seq, refusals[seq.request_id])
            if seq.request_id in refusals
            else self._result(finished[seq.request_id], request)
            for seq, request in zip(sequences, pending)
        ]
        return SimResult(results, steps, self.config, core.scheduler.num_preemptions, clock.now(),
                         time.perf_counter() - wall_start)  # fmt: skip

    def queue_state(self) -> QueueState:
        """What the server's front end would see of the running simulation now: the core's counts, the prompt
        tokens of its requests with no first token yet, and the rates measured so far
        (:meth:`QueueState.of_counts`, the rule the server's :meth:`QueueState.of` uses too)."""
        if self.core is None or self.meter is None:
            raise RuntimeError("queue_state() is read during a run with an admission policy")
        core = self.core
        queued = sum(len(seq.prompt_token_ids) for seq in core.requests.values() if not seq.output_token_ids)
        return QueueState.of_counts(core.stats(), queued, self.meter.rates, self.config.max_num_seqs)

    def _gate(self, seq: EngineSequence, request: SimRequest, refusals: dict[str, Refusal]) -> Callable[[float], None]:
        """At ``seq``'s arrival: ask the admission policy, then add it to the core or note its refusal."""
        facts = RequestFacts(request.prompt_tokens, request.output_tokens, request.deadline_s)
        add = _adder(self.core, seq)

        def arrive(arrival_s: float) -> None:
            refusal = self.admission.decide(facts, self.queue_state())
            if refusal is None:
                add(arrival_s)
            else:
                refusals[seq.request_id] = refusal

        return arrive

    @staticmethod
    def _refused(request: SimRequest, seq: EngineSequence, refusal: Refusal) -> SimulatedRequest:
        """A refused request: arrived, refused at once (finished at its arrival), no tokens."""
        arrival = request.arrival_s
        metrics = RequestMetrics(arrival_time_s=arrival, finish_time_s=arrival)
        return SimulatedRequest(seq.request_id, request.prompt_tokens, 0, "refused", metrics, 0, 0,
                                request.priority, refusal)  # fmt: skip

    @staticmethod
    def _sequence(request: SimRequest, arrival_index: int) -> EngineSequence:
        arrival = request.arrival_s
        return EngineSequence(
            request_id=request.request_id if request.request_id is not None else str(arrival_index),
            prompt=None,
            prompt_token_ids=list(request.prompt_token_ids),
            params=SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
            metrics=RequestMetrics(arrival_time_s=arrival),
            detokenizer=IncrementalDetokenizer(_NoText()),
            arrival_index=arrival_index,
            priority=request.priority,
            deadline_s=None if request.deadline_s is None else arrival + request.deadline_s,
            waiting_since_s=arrival,
        )

    @staticmethod
    def _result(output: RequestOutput, request: SimRequest) -> SimulatedRequest:
        return SimulatedRequest(
            request_id=output.request_id,
            prompt_tokens=len(output.prompt_token_ids),
            output_tokens=len(output.token_ids),
            finish_reason=output.finish_reason,
            metrics=output.metrics,
            num_preemptions=output.num_preemptions,
            num_cached_tokens=output.num_cached_tokens,
            priority=request.priority,
        )


def _adder(core: EngineCore, seq: EngineSequence) -> Callable[[float], None]:
    """Add ``seq`` when it arrives (the simulator stamps its arrival time itself: ``arrival_s`` is exact)."""
    return lambda arrival_s: core.add(seq, tokenized_s=arrival_s)


def simulate(
    requests: Iterable[SimRequest],
    cost_model: StepCost,
    config: SchedulerConfig | None = None,
    admission: AdmissionPolicy | None = None,
    **knobs: Any,
) -> SimResult:
    """Run ``requests`` through a fresh :class:`Simulator` (behind ``admission``, if given); ``knobs`` are
    :class:`SchedulerConfig` fields."""
    config = (config or SchedulerConfig()).replace(**knobs)
    return Simulator(cost_model, config, admission=admission).run(requests)


__all__ = [
    "SchedulerConfig",  # the simulator's two inputs besides the requests, re-exported for one import line
    "SimRequest",
    "SimResult",
    "SimulatedRequest",
    "Simulator",
    "StepCostModel",
    "StepRecord",
    "make_requests",
    "simulate",
]

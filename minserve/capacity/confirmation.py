"""The capacity envelope confirmed on the engine: predicted, then measured, at rates around the knee.

:func:`confirm_on_engine` takes an :class:`~minserve.capacity.envelope.Envelope` planned for this machine
(a cost model calibrated on the same engine) and serves its workload on the real engine at a few arrival
rates, by default below, at and above the highest rate the planner says meets the SLO. Each run's requests
(the same token ids, lengths and arrival times) go through the simulator too, so each row lays a prediction
beside the measurement of exactly the same requests. The engine is driven on the wall clock by
:func:`minserve.measure.arrivals.serve_arrivals`, over the loop the simulator runs on: an open-loop load test
in one process, each request added when its arrival time comes, whether or not the engine keeps up.

It drives the engine, so the package's ``__init__`` does not import it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minserve import slo
from minserve.capacity.envelope import Envelope
from minserve.capacity.planner import RateProbe
from minserve.capacity.simulator import SchedulerConfig, SimRequest, Simulator
from minserve.engine.outputs import RequestOutput
from minserve.measure.arrivals import serve_arrivals

if TYPE_CHECKING:
    from minserve.engine.engine import LLMEngine
    from minserve.engine.llm import LLM

DEFAULT_SHARES = (0.5, 1.0, 1.5)  # of the predicted highest rate: below the knee, at it, past it


@dataclass(frozen=True)
class EngineCheck:
    """One rate: the simulator's prediction and the engine's measurement of the same requests."""

    rate_rps: float
    share_of_max: float  # the rate ÷ the envelope's highest rate meeting the SLO
    predicted: RateProbe
    measured: RateProbe
    wall_s: float  # the engine run's real seconds

    def as_row(self) -> dict[str, Any]:
        """A flat row for a table: attainment, the SLO-percentile TTFT and TPOT, goodput, each predicted and
        measured."""
        row: dict[str, Any] = {"rate_rps": self.rate_rps, "share_of_max": self.share_of_max}
        for side, probe in (("predicted", self.predicted), ("measured", self.measured)):
            row |= {
                f"{side}_attainment": probe.attainment["all"],
                f"{side}_ttft_ms": probe.ttft_ms,
                f"{side}_tpot_ms": probe.tpot_ms,
                f"{side}_goodput_rps": probe.goodput_rps,
                f"{side}_meets_slo": probe.meets_slo,
            }
        return row | {"wall_s": self.wall_s}


def serve_on_engine(llm: LLM | LLMEngine, requests: Sequence[SimRequest], id_prefix: str = "") -> list[RequestOutput]:
    """Serve ``requests`` on the engine, each added when the wall clock passes the run's start plus its
    ``arrival_s`` and asking for exactly its ``output_tokens`` (greedy, ``ignore_eos``); the outputs in the
    order given. The engine must be idle."""
    engine = getattr(llm, "engine", llm)
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; confirm on an idle engine")
    ids = [f"{id_prefix}{request.request_id or index}" for index, request in enumerate(requests)]
    return serve_arrivals(engine, requests, ids)


def confirm_on_engine(
    llm: LLM | LLMEngine,
    envelope: Envelope,
    rates_rps: Sequence[float] | None = None,
    num_requests: int | None = None,
    prompt_seed_offset: int = 1,
) -> list[EngineCheck]:
    """Predicted against measured at each of ``rates_rps`` (default: :data:`DEFAULT_SHARES` of the envelope's
    highest rate meeting the SLO), ``num_requests`` each (default: the envelope's workload's).

    The envelope must have been planned for this engine: its machine's scheduler settings (KV blocks, batch,
    budget, policy) must be the engine's, or the prediction is of another engine. Each rate sends the
    planner's run (the same lengths and arrival gaps, scaled to the rate) with fresh prompt token ids
    (``prompt_seed_offset`` + its index): the engine's prefix cache remembers the last run's prompts, the
    simulator's starts empty.
    """
    engine = getattr(llm, "engine", llm)
    mine, planned = SchedulerConfig.from_engine(engine).to_dict(), envelope.machine.config.to_dict()
    differ = sorted(key for key in planned if planned[key] != mine.get(key))
    if differ:
        raise ValueError(f"the envelope was planned for another engine: {', '.join(differ)} differ "
                         f"({', '.join(f'{k} {planned[k]} vs {mine.get(k)}' for k in differ)})")  # fmt: skip
    if rates_rps is None:
        if envelope.max_rate_rps <= 0:
            raise ValueError("the envelope has no rate that meets the SLO; give rates_rps to measure anyway")
        rates_rps = [share * envelope.max_rate_rps for share in DEFAULT_SHARES]
    workload = envelope.workload
    if num_requests is not None:
        workload = dataclasses.replace(workload, num_requests=num_requests)
    machine, target, required = envelope.machine, envelope.slo_target, envelope.required_attainment
    vocab_size = engine.model_config.vocab_size
    checks = []
    for index, rate in enumerate(rates_rps):
        requests = workload.requests(rate, vocab_size, prompt_seed_offset + index)
        simulated = Simulator(machine.cost, machine.config).run(requests)
        predicted = RateProbe.of(rate, simulated.records, [r.metrics for r in simulated.requests], target, required,
                                 simulated.num_preemptions)  # fmt: skip
        start = time.perf_counter()
        outputs = serve_on_engine(engine, requests, id_prefix=f"confirm-{prompt_seed_offset + index}-")
        wall_s = time.perf_counter() - start
        measured = RateProbe.of(rate, slo.records_from_outputs(outputs), [o.metrics for o in outputs], target,
                                required, sum(o.num_preemptions for o in outputs))  # fmt: skip
        share = rate / envelope.max_rate_rps if envelope.max_rate_rps > 0 else float("nan")
        checks.append(EngineCheck(rate, share, predicted, measured, wall_s))
    return checks

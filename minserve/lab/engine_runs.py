"""Chapter 05's engine experiments: requests added at their arrival times (or after a number of steps),
the engine stepped until all are done, and every step recorded.

:func:`run_engine` serves the requests with :func:`minserve.measure.arrivals.serve_arrivals` (over the loop
the simulator runs on) and records each step from the engine core's :class:`~minserve.engine.step_report.StepReport`
(:class:`minserve.measure.steps.StepRecorder`): tokens, sequences, and what every request in flight was doing
(prefill, decode, recompute, waiting, swapped).
Requests are :class:`~minserve.capacity.simulator.SimRequest` s, the simulator's own description, so one
list feeds both. The result, an :class:`EngineRun`, turns into tables (:meth:`EngineRun.table`,
:func:`batching_table`, :func:`trace_table`), SLO records and summaries; :mod:`minserve.lab.scheduling`
draws it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from minserve import slo
from minserve.capacity.simulator import (
    SimRequest,
    make_requests,
)
from minserve.engine.outputs import RequestOutput
from minserve.engine.step_report import StepReport
from minserve.lab.theme import COLORWAY
from minserve.measure.arrivals import LEAD_S, serve_arrivals
from minserve.measure.steps import StepRecorder
from minserve.trace import TraceEvent

if TYPE_CHECKING:
    from minserve.engine.llm import LLM

# What a request in flight does in one step, and the colour it has in every figure.
STATE_COLORS: dict[str, str] = {
    "prefill": COLORWAY[1],  # a prompt chunk
    "decode": COLORWAY[0],  # one new token
    "recompute": COLORWAY[5],  # a preempted request's prompt and output, computed again
    "waiting": "#D9D9D9",  # queued: arrived, or preempted by recompute
    "swapped": COLORWAY[3],  # preempted by swap: its KV blocks in host memory
}
RUNNING_STATES = ("prefill", "decode", "recompute")
SIDE_LEGEND = {"orientation": "v", "y": 1, "x": 1.02, "xanchor": "left", "yanchor": "top"}  # clear of subplot titles
# The settings chapter 05 calibrates with: a few seconds on a 2-core CPU instead of calibrate()'s ~10.
QUICK_CALIBRATION: dict[str, Any] = {
    "single_prompts": 8,
    "batch_sizes": (1, 4, 16),
    "context_lengths": (64, 256),
    "decode_steps": 12,
    "mixed_requests": 60,
    "mixed_gaps_steps": (6.0, 1.5),
    "max_output_tokens": 48,
}


# --- driving the engine -------------------------------------------------------------------------------------


@dataclass
class EngineRun:
    """One run of :func:`run_engine`: the requests, their outputs, and every step as the scheduler built it.

    ``steps``: one row per ``engine.step()`` (``step`` from 1, ``start_s`` from the run's start, ``duration_s``,
    ``tokens``, ``seqs``, ``prefill_tokens``, ``decode_seqs``, ``running``, ``waiting`` and ``swapped`` after
    scheduling, ``preempted``, ``admitted``, ``swapped_blocks``). ``occupancy``: one row per request in flight per
    step (``step``, ``request_id``, ``state`` from :data:`STATE_COLORS`, ``tokens`` it ran). ``arrival_step``:
    how many steps had run when each request was added; ``token_steps``: the step that gave each of its
    tokens; ``preemptions``: ``(step, request_id)`` pairs. ``events``: the run's trace events.
    """

    requests: list[SimRequest]
    outputs: list[RequestOutput]
    steps: pd.DataFrame
    occupancy: pd.DataFrame
    arrival_step: dict[str, int]
    token_steps: dict[str, list[int]]
    preemptions: list[tuple[int, str]]
    events: list[TraceEvent]
    wall_s: float

    @property
    def request_ids(self) -> list[str]:
        return [_request_id(r, i) for i, r in enumerate(self.requests)]

    def output(self, request_id: str) -> RequestOutput:
        for out in self.outputs:
            if out.request_id == request_id:
                return out
        raise KeyError(request_id)

    @property
    def records(self) -> list[slo.RequestRecord]:
        """Every finished request for :mod:`minserve.slo`; one stopped at its deadline counts as failed."""
        return [
            slo.record_from_metrics(
                out.metrics,
                "ok" if out.finish_reason in ("stop", "length") else "failed",
                len(out.prompt_token_ids),
                out.request_id,
            )
            for out in self.outputs
        ]

    def summary(self, slo_target: slo.SLO | None = None) -> dict[str, Any]:
        """:func:`minserve.slo.summarize` of the run, plus its steps: what a simulation reports."""
        return slo.summarize(self.records, slo_target) | {"steps": len(self.steps), "wall_s": self.wall_s}

    def ttft_steps(self, request_id: str) -> int:
        """Steps from the request's arrival to the step that gave its first token (1: the very next step)."""
        return self.token_steps[request_id][0] - self.arrival_step[request_id]

    def finish_step(self, request_id: str) -> int:
        """The step that gave the request's last token."""
        return self.token_steps[request_id][-1]

    def table(self) -> pd.DataFrame:
        """One row per finished request: its lengths and priority, TTFT and E2E in steps and in ms, how long it
        waited and ran (``metrics.waiting_s`` and ``running_s``), its preemptions and why it finished."""
        by_id = {_request_id(r, i): r for i, r in enumerate(self.requests)}
        rows = []
        for out in self.outputs:
            rid, m = out.request_id, out.metrics
            tokens = self.token_steps.get(rid, [])
            rows.append(
                {
                    "request": rid,
                    "prompt tokens": len(out.prompt_token_ids),
                    "output tokens": len(out.token_ids),
                    "priority": by_id[rid].priority if rid in by_id else 0,
                    "arrival step": self.arrival_step[rid],
                    "TTFT steps": tokens[0] - self.arrival_step[rid] if tokens else math.nan,
                    "finish step": tokens[-1] if tokens else math.nan,
                    "TTFT ms": m.ttft_s * 1e3 if m.ttft_s is not None else math.nan,
                    "E2E ms": m.e2e_s * 1e3 if m.e2e_s is not None else math.nan,
                    "waiting ms": m.waiting_s * 1e3,
                    "running ms": m.running_s * 1e3 if m.running_s is not None else math.nan,
                    "preemptions": sum(1 for _, p in self.preemptions if p == rid),
                    "finish": out.finish_reason,
                }
            )
        return pd.DataFrame(rows).set_index("request")

    def itl_ms(self, request_ids: Sequence[str] | None = None) -> pd.DataFrame:
        """Every gap between two tokens of the given requests (default: all): ``request_id``, ``step`` (the step
        that gave the later token), ``itl_ms``."""
        wanted = set(self.request_ids if request_ids is None else request_ids)
        rows = []
        for out in self.outputs:
            if out.request_id not in wanted:
                continue
            times, steps = out.metrics.token_times_s, self.token_steps[out.request_id]
            for k in range(1, len(times)):
                rows.append({"request_id": out.request_id, "step": steps[k], "itl_ms": (times[k] - times[k - 1]) * 1e3})
        return pd.DataFrame(rows, columns=["request_id", "step", "itl_ms"])


def _request_id(request: SimRequest, index: int) -> str:
    return request.request_id if request.request_id is not None else str(index)


def _step_row(report: StepReport, step: int, origin_s: float) -> dict[str, Any]:
    """One row of the steps table, from the engine core's report of the step."""
    decode_seqs = sum(1 for s in report.scheduled if s.state == "decode")
    return {
        "step": step,
        "start_s": report.began_s - origin_s,
        "duration_s": report.step_s,
        "tokens": report.num_tokens,
        "seqs": len(report.scheduled),
        "prefill_tokens": sum(s.num_new_tokens for s in report.scheduled if s.state != "decode"),
        "decode_seqs": decode_seqs,
        "running": report.num_running,
        "waiting": len(report.waiting),
        "swapped": len(report.swapped),
        "preempted": len(report.preempted),
        "admitted": len(report.admitted),
        "swapped_blocks": report.num_swapped_blocks,
    }


def run_engine(
    llm: LLM,
    requests: Sequence[SimRequest],
    at_steps: Sequence[int] | None = None,
    temperature: float = 0.0,
    max_steps: int = 1_000_000,
) -> EngineRun:
    """Serve ``requests`` on ``llm``'s engine, one ``step()`` at a time, recording every step.

    Without ``at_steps``, request ``i`` is added when the wall clock passes the run's start plus its
    ``arrival_s`` (stamped with that time, so a request that arrives during a step waits for it, as a client's
    would), and the loop sleeps while nothing is in flight: an open-loop load test in one process. With
    ``at_steps``, request ``i`` is added once ``at_steps[i]`` steps have run (0: before the first), whatever the
    time: step-exact experiments that come out the same on every machine. Both are
    :func:`minserve.measure.arrivals.serve_arrivals`; the steps are recorded from the engine core's step
    reports (:class:`minserve.measure.steps.StepRecorder`).

    Each request asks for exactly ``output_tokens`` tokens (``ignore_eos``), greedy unless ``temperature``
    says otherwise; its ``priority`` and ``deadline_s`` go to the engine. The engine must be idle.
    """
    engine = llm.engine
    requests = list(requests)
    ids = [_request_id(r, i) for i, r in enumerate(requests)]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    core = engine.core
    base_step = core.num_steps  # the engine may have run before: this run's steps count from here
    arrival_step: dict[str, int] = {}
    start = time.perf_counter() + (0.0 if at_steps is not None else LEAD_S)

    def arrived(i: int) -> None:
        arrival_step[ids[i]] = core.num_steps - base_step

    with StepRecorder(core) as recorder:
        outputs = serve_arrivals(engine, requests, ids, at_steps, start, temperature, arrived, max_steps)
    wall_s = time.perf_counter() - start
    ours = set(ids)
    events = [e for e in llm.tracer.events if e.request_id in ours and e.start_s >= start - 1e-3]
    steps = _StepLog(ids, base_step, start)
    for report in recorder.reports:
        steps.add(report)
    return EngineRun(
        requests=requests,
        outputs=outputs,
        steps=pd.DataFrame(steps.rows),
        occupancy=pd.DataFrame(steps.occupancy, columns=["step", "request_id", "state", "tokens"]),
        arrival_step=arrival_step,
        token_steps=steps.token_steps,
        preemptions=steps.preemptions,
        events=events,
        wall_s=wall_s,
    )


class _StepLog:
    """The run's step reports as tables: a row per step, who was in flight doing what, the step that gave
    each request's tokens, and the preemptions. Steps count from 1 after ``base_step``."""

    def __init__(self, ids: Sequence[str], base_step: int, origin_s: float) -> None:
        self.base_step, self.origin_s = base_step, origin_s
        self.seen: dict[str, int] = {}
        self.token_steps: dict[str, list[int]] = {rid: [] for rid in ids}
        self.rows: list[dict[str, Any]] = []
        self.occupancy: list[tuple[int, str, str, int]] = []
        self.preemptions: list[tuple[int, str]] = []

    def add(self, report: StepReport) -> None:
        step = report.index - self.base_step
        for out in report.outputs:
            if len(out.token_ids) > self.seen.get(out.request_id, 0):
                self.token_steps[out.request_id].append(step)
                self.seen[out.request_id] = len(out.token_ids)
        self.occupancy.extend((step, s.request_id, s.state, s.num_new_tokens) for s in report.scheduled)
        self.occupancy.extend((step, rid, "waiting", 0) for rid in report.waiting)
        self.occupancy.extend((step, rid, "swapped", 0) for rid in report.swapped)
        self.preemptions.extend((step, rid) for rid in report.preempted)
        self.rows.append(_step_row(report, step, self.origin_s))


def requests_with_prompts(
    prompt_lengths: Sequence[int],
    output_lengths: Sequence[int] | int,
    vocab_size: int,
    seed: int = 0,
    arrivals_s: Sequence[float] | None = None,
    priorities: Sequence[int] | None = None,
    deadlines_s: Sequence[float | None] | float | None = None,
    prefix: str = "",
) -> list[SimRequest]:
    """Requests with fresh random prompts of the given lengths (no two share a cached block), ids ``prefix0``,
    ``prefix1``…; arrivals default to 0 (all at once). A thin layer over
    :func:`minserve.capacity.simulator.make_requests`."""
    n = len(prompt_lengths)
    made = make_requests(
        [0.0] * n if arrivals_s is None else list(arrivals_s),
        list(prompt_lengths),
        output_lengths if isinstance(output_lengths, int) else list(output_lengths),
        vocab_size=vocab_size,
        seed=seed,
        priorities=priorities,
        deadlines_s=deadlines_s,
    )
    return [SimRequest(r.arrival_s, r.prompt_token_ids, r.output_tokens, r.priority, r.deadline_s, f"{prefix}{i}")
            for i, r in enumerate(made)]  # fmt: skip


# --- tables of a run ------------------------------------------------------------------------------------------


def batching_table(runs: Mapping[str, EngineRun]) -> pd.DataFrame:
    """Per run: steps, wall seconds, output tokens per step and per second, mean and p90 E2E (steps and ms),
    the mean batch (sequences per step)."""
    rows = []
    for label, run in runs.items():
        table = run.table()
        tokens = int(table["output tokens"].sum())
        e2e_steps = table["finish step"] - table["arrival step"]
        rows.append(
            {
                "run": label,
                "steps": len(run.steps),
                "wall s": run.wall_s,
                "tokens/step": tokens / len(run.steps),
                "tokens/s": tokens / run.wall_s,
                "mean batch": run.steps["seqs"].mean(),
                "mean E2E steps": e2e_steps.mean(),
                "mean E2E ms": table["E2E ms"].mean(),
                "p90 E2E ms": table["E2E ms"].quantile(0.9),
            }
        )
    return pd.DataFrame(rows).set_index("run")


def trace_table(run: EngineRun, names: Sequence[str] = ("preempted", "resumed")) -> pd.DataFrame:
    """The run's trace events of the given names, in time order: ``ms`` since the run's first event,
    ``request``, ``event``, and the event's arguments (a preemption's ``mode``)."""
    events = sorted((e for e in run.events if e.name in names), key=lambda e: e.start_s)
    origin = min((e.start_s for e in run.events), default=0.0)
    rows = [{"ms": (e.start_s - origin) * 1e3, "request": e.request_id, "event": e.name, **e.args} for e in events]
    return pd.DataFrame(rows)

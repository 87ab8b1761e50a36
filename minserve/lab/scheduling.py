"""Chapter 05: the engine driven request by request and recorded step by step; the simulator swept; the playground.

Four groups:

* **driving the engine**: :func:`run_engine` adds requests (:class:`~minserve.capacity.simulator.SimRequest`,
  the simulator's own description of a request, so one list feeds both) at their arrival times on the wall
  clock, or after a given number of steps, calls ``engine.step()`` until every request has finished, and
  records what the scheduler put in each step: tokens, sequences, and what every request in flight was
  doing (prefill, decode, recompute, waiting, swapped). The result, an :class:`EngineRun`, turns into
  tables (:meth:`EngineRun.table`), SLO records and summaries;
* **figures of a run**: the step-occupancy (Gantt) view of who ran when (:func:`occupancy_figure`), tokens per
  step and the inter-token latency of running decodes (:func:`chunked_prefill_figure`), time spent waiting
  against running (:func:`waiting_running_figure`);
* **the simulator**: a workload with head-of-line blocking (:func:`mixed_workload`), the simulator laid
  beside the engine (:func:`validation_table`, :func:`validation_figure`), policies swept over arrival
  rates (:func:`policy_sweep`, :func:`sweep_figure`), and a long prompt in a stream of short ones
  (:func:`stream_with_long_request`, :func:`starvation_figure`);
* **the scheduling playground** widget, whose whole callback is the plain function :func:`playground_result`.

The recorder wraps ``engine.scheduler.schedule`` on that one scheduler instance for the run and restores it
after (as :func:`minserve.capacity.calibration.measure_steps` does); nothing in the engine changes.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import slo
from minserve.capacity.simulator import (
    SchedulerConfig,
    SimRequest,
    SimResult,
    SimulatedRequest,
    Simulator,
    StepCostModel,
    make_requests,
)
from minserve.engine.core import StepReport
from minserve.engine.driver import Arrival, drive
from minserve.engine.outputs import RequestOutput
from minserve.engine.policies import Policy, ShortestPromptFirst
from minserve.engine.sampling_params import SamplingParams
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme
from minserve.trace import TraceEvent
from minserve.workload import poisson_arrivals

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

    def summary(self, slo_target: slo.SLO | None = None) -> dict[str, float]:
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
    :func:`minserve.engine.driver.drive`; the steps are recorded from the engine core's step reports.

    Each request asks for exactly ``output_tokens`` tokens (``ignore_eos``), greedy unless ``temperature``
    says otherwise; its ``priority`` and ``deadline_s`` go to the engine. The engine must be idle.
    """
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; run on an idle engine")
    requests = list(requests)
    n = len(requests)
    if at_steps is not None and len(at_steps) != n:
        raise ValueError(f"{len(at_steps)} arrival steps for {n} requests")
    ids = [_request_id(r, i) for i, r in enumerate(requests)]
    if len(set(ids)) != n:
        raise ValueError("request ids must be unique")
    core = engine.core
    base_step = core.num_steps  # the engine may have run before: this run's steps count from here
    seen: dict[str, int] = {}
    token_steps: dict[str, list[int]] = {rid: [] for rid in ids}
    arrival_step: dict[str, int] = {}
    step_rows: list[dict[str, Any]] = []
    occupancy: list[tuple[int, str, str, int]] = []
    preemptions: list[tuple[int, str]] = []
    start = time.perf_counter() + (0.0 if at_steps is not None else 0.005)

    def record(report: StepReport) -> None:
        step = report.index - base_step
        for out in report.outputs:
            if len(out.token_ids) > seen.get(out.request_id, 0):
                token_steps[out.request_id].append(step)
                seen[out.request_id] = len(out.token_ids)
        occupancy.extend((step, s.request_id, s.state, s.num_new_tokens) for s in report.scheduled)
        occupancy.extend((step, rid, "waiting", 0) for rid in report.waiting)
        occupancy.extend((step, rid, "swapped", 0) for rid in report.swapped)
        preemptions.extend((step, rid) for rid in report.preempted)
        step_rows.append(_step_row(report, step, start))

    def adder(i: int) -> Callable[[float], None]:
        r = requests[i]
        params = SamplingParams(max_tokens=r.output_tokens, temperature=temperature, ignore_eos=True)

        def add(arrival_s: float) -> None:
            prompt = list(r.prompt_token_ids)
            engine.add_request(prompt, params, ids[i], arrival_s, prompt, r.priority, r.deadline_s)
            arrival_step[ids[i]] = core.num_steps - base_step

        return add

    due = list(at_steps) if at_steps is not None else [r.arrival_s for r in requests]
    core.observers.append(record)
    try:
        finished = drive(core, [Arrival(due[i], adder(i)) for i in range(n)], start, at_steps is not None, max_steps)
    finally:
        core.observers.remove(record)
    wall_s = time.perf_counter() - start
    ours = set(ids)
    events = [e for e in llm.tracer.events if e.request_id in ours and e.start_s >= start - 1e-3]
    return EngineRun(
        requests=requests,
        outputs=[finished[rid] for rid in ids if rid in finished],
        steps=pd.DataFrame(step_rows),
        occupancy=pd.DataFrame(occupancy, columns=["step", "request_id", "state", "tokens"]),
        arrival_step=arrival_step,
        token_steps=token_steps,
        preemptions=preemptions,
        events=events,
        wall_s=wall_s,
    )


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


# --- figures of a run ---------------------------------------------------------------------------------------


def occupancy_segments(run: EngineRun) -> pd.DataFrame:
    """The occupancy as runs of consecutive steps in one state: ``request_id``, ``state``, ``first``, ``last``
    (steps, inclusive), ``tokens`` (run in the segment)."""
    occ = run.occupancy
    if occ.empty:
        return pd.DataFrame(columns=["request_id", "state", "first", "last", "tokens"])
    rows = []
    for rid, group in occ.sort_values("step", kind="stable").groupby("request_id", sort=False):
        current: list[Any] | None = None
        for step, state, tokens in zip(group["step"], group["state"], group["tokens"]):
            if current is not None and current[1] == state and step == current[3] + 1:
                current[3] = step
                current[4] += tokens
                continue
            if current is not None:
                rows.append(current)
            current = [rid, state, step, step, tokens]
        rows.append(current)
    return pd.DataFrame(rows, columns=["request_id", "state", "first", "last", "tokens"])


def occupancy_figure(
    runs: Mapping[str, EngineRun] | EngineRun, title: str | None = None, show_waiting: bool = True
) -> go.Figure:
    """Who ran when: one row per request (in arrival order, the first on top), one bar per stretch of steps in
    one state, coloured by :data:`STATE_COLORS`; an ✕ where a request was preempted. Several runs are stacked
    on one step axis, so a run that took more steps is visibly longer."""
    runs = {"": runs} if isinstance(runs, EngineRun) else dict(runs)
    fig = make_subplots(
        rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[k for k in runs]
    )
    shown: set[str] = set()
    for row, run in enumerate(runs.values(), start=1):
        segments = occupancy_segments(run)
        order = [rid for rid in run.request_ids if rid in set(run.occupancy["request_id"])]
        for state, color in STATE_COLORS.items():
            if state == "waiting" and not show_waiting:
                continue
            part = segments[segments["state"] == state]
            if part.empty:
                continue
            fig.add_trace(
                go.Bar(
                    y=part["request_id"],
                    x=part["last"] - part["first"] + 1,
                    base=part["first"] - 0.5,
                    orientation="h",
                    name=state,
                    legendgroup=state,
                    showlegend=state not in shown,
                    marker={"color": color, "line": {"width": 0}},
                    customdata=np.stack([part["first"], part["last"], part["tokens"]], axis=-1),
                    hovertemplate=f"request %{{y}}: {state}, steps %{{customdata[0]}}–%{{customdata[1]}}, "
                    "%{customdata[2]} tokens<extra></extra>",
                ),
                row=row,
                col=1,
            )
            shown.add(state)
        if run.preemptions:
            fig.add_trace(
                go.Scatter(
                    x=[s for s, _ in run.preemptions],
                    y=[rid for _, rid in run.preemptions],
                    mode="markers",
                    name="preempted",
                    legendgroup="preempted",
                    showlegend="preempted" not in shown,
                    marker={"symbol": "x", "color": "black", "size": 9},
                    hovertemplate="request %{y} preempted at step %{x}<extra></extra>",
                ),
                row=row,
                col=1,
            )
            shown.add("preempted")
        fig.update_yaxes(
            categoryorder="array", categoryarray=order[::-1], title_text="request", row=row, col=1, showgrid=False
        )
    fig.update_xaxes(title_text="engine step", row=len(runs), col=1)
    fig.update_layout(
        template=register_course_theme(),
        barmode="overlay",
        bargap=0.15,
        height=max(320, 260 * len(runs)),
        title=title or "Step occupancy: what each request did at every step",
        legend=SIDE_LEGEND,
    )
    return fig


def chunked_prefill_figure(
    runs: Mapping[str, EngineRun],
    decode_ids: Sequence[str],
    budget: int,
    arrival_step: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """Top: tokens run in each step, per run, with the step budget. Bottom: the gap before each token of the
    requests in ``decode_ids`` (ms), at the step that gave the token. ``arrival_step`` marks when the long
    prompt arrived."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("tokens run per step", "inter-token latency of the running decodes (ms)"),
    )
    for i, (label, run) in enumerate(runs.items()):
        color = COLORWAY[i % len(COLORWAY)]
        fig.add_trace(
            go.Scatter(
                x=run.steps["step"],
                y=run.steps["tokens"],
                name=f"{label}: tokens/step",
                line_shape="hv",
                line={"color": color},
                legendgroup=label,
            ),
            row=1,
            col=1,
        )
        itl = run.itl_ms(decode_ids)
        fig.add_trace(
            go.Scatter(
                x=itl["step"],
                y=itl["itl_ms"],
                mode="markers",
                name=f"{label}: ITL",
                legendgroup=label,
                marker={"color": color, "size": 6, "symbol": "circle" if i == 0 else "diamond"},
                text=itl["request_id"],
                hovertemplate="request %{text}, step %{x}: %{y:.1f} ms<extra></extra>",
            ),
            row=2,
            col=1,
        )
    last = max(int(run.steps["step"].max()) for run in runs.values())
    fig.add_trace(
        go.Scatter(
            x=[0.5, last + 0.5],
            y=[budget, budget],
            mode="lines",
            name=f"budget: {budget} tokens",
            line={"color": SLO_COLOR, "dash": "dash"},
        ),
        row=1,
        col=1,
    )
    if arrival_step is not None:
        fig.add_vline(x=arrival_step + 0.5, line_dash="dot", line_color="gray")
    fig.update_yaxes(type="log", title_text="tokens", row=1, col=1)
    fig.update_yaxes(type="log", title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text="engine step", row=2, col=1)
    fig.update_layout(
        template=register_course_theme(),
        height=560,
        title=title or "A long prompt arrives among running decodes (dotted line)",
        legend=SIDE_LEGEND,
    )
    return fig


def waiting_running_figure(runs: Mapping[str, EngineRun] | EngineRun, title: str | None = None) -> go.Figure:
    """Per request, in arrival order: its end-to-end time split into waiting (queued or preempted) and running
    (``metrics.waiting_s`` and ``metrics.running_s``), stacked, in ms. Several runs side by side, one y axis."""
    runs = {"": runs} if isinstance(runs, EngineRun) else dict(runs)
    fig = make_subplots(rows=1, cols=len(runs), shared_yaxes=True, subplot_titles=list(runs), horizontal_spacing=0.04)
    for col, run in enumerate(runs.values(), start=1):
        table = run.table()
        labels = [f"{rid} ({reason})" if reason not in ("length", "stop") else rid
                  for rid, reason in zip(table.index, table["finish"])]  # fmt: skip
        for name, column, state in (("waiting", "waiting ms", "waiting"), ("running", "running ms", "decode")):
            fig.add_trace(
                go.Bar(
                    x=labels,
                    y=table[column],
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    marker_color=STATE_COLORS[state],
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="request (arrival order)", row=1, col=col)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_layout(
        template=register_course_theme(),
        barmode="stack",
        title=title or "Where each request's time went: waiting vs running",
        legend=SIDE_LEGEND,
    )
    return fig


# --- the simulator ------------------------------------------------------------------------------------------


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
    return Simulator(cost, config).run(at_once).summary()["throughput_rps"]


COMPARED: tuple[tuple[str, str], ...] = (
    ("ttft_p50_ms", "TTFT p50 (ms)"),
    ("ttft_p90_ms", "TTFT p90 (ms)"),
    ("tpot_p50_ms", "TPOT p50 (ms)"),
    ("output_tokens_per_s", "output tokens/s"),
)


def validation_table(
    measured: Mapping[str, Mapping[str, float]], simulated: Mapping[str, Mapping[str, float]]
) -> pd.DataFrame:
    """One row per (run, metric): ``measured``, ``simulated`` and ``sim / measured``, for the metrics in
    :data:`COMPARED`. ``measured`` and ``simulated`` map a run's label to its :func:`minserve.slo.summarize` dict."""
    rows = []
    for label, m in measured.items():
        s = simulated[label]
        for key, name in COMPARED:
            ratio = s[key] / m[key] if m[key] else math.nan
            rows.append(
                {"run": label, "metric": name, "measured": m[key], "simulated": s[key], "sim / measured": ratio}
            )
    return pd.DataFrame(rows).set_index(["run", "metric"])


def validation_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """One panel per metric of :func:`validation_table`: measured and simulated side by side for each run."""
    metrics = list(dict.fromkeys(table.index.get_level_values("metric")))
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics)
    for col, metric in enumerate(metrics, start=1):
        part = table.xs(metric, level="metric")
        for i, side in enumerate(("measured", "simulated")):
            fig.add_trace(
                go.Bar(
                    x=list(part.index),
                    y=part[side],
                    name=side,
                    legendgroup=side,
                    showlegend=col == 1,
                    marker_color=COLORWAY[i],
                    marker_pattern_shape="" if i == 0 else "/",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        template=register_course_theme(),
        barmode="group",
        title=title or "The simulator against the engine: the same requests, measured and simulated",
        height=380,
        legend=SIDE_LEGEND,
    )
    return fig


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
) -> pd.DataFrame:
    """Simulate ``workload(rate)`` under every policy at every rate: one row per (policy, rate) with goodput,
    throughput, attainment, TTFT and TPOT percentiles, short and long requests' TTFT (:func:`class_summary`),
    steps, preemptions, and the seconds the simulation took (``sim_wall_s``). Every policy sees the same
    requests at a given rate."""
    rows = []
    for rate in rates_rps:
        requests = list(workload(rate))
        for label, policy in policies.items():
            result = Simulator(cost, SchedulerConfig(**{**config.__dict__, "scheduling_policy": policy})).run(requests)
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
    return pd.DataFrame(rows)


def sweep_figure(sweep: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Three panels against the arrival rate, one line per policy: goodput, short requests' p99 TTFT and the
    longest TTFT of a long request (log scale: starvation is off the chart otherwise)."""
    panels = (
        ("goodput_rps", "goodput (requests/s meeting the SLO)", "linear"),
        ("ttft_short_p99_ms", "short requests: p99 TTFT (ms)", "log"),
        ("ttft_long_max_ms", "long requests: longest TTFT (ms)", "log"),
    )
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels], horizontal_spacing=0.08)
    for i, (policy, part) in enumerate(sweep.groupby("policy", sort=False)):
        for col, (key, _, _) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scatter(
                    x=part["rate_rps"],
                    y=part[key],
                    mode="lines+markers",
                    name=policy,
                    legendgroup=policy,
                    showlegend=col == 1,
                    line={"color": COLORWAY[i % len(COLORWAY)]},
                ),
                row=1,
                col=col,
            )
    for col, (_, _, axis) in enumerate(panels, start=1):
        fig.update_xaxes(title_text="arrival rate (requests/s)", row=1, col=col)
        fig.update_yaxes(type=axis, row=1, col=col)
    fig.update_layout(
        template=register_course_theme(),
        height=420,
        title=title or "Policies × arrival rates, simulated",
        legend=SIDE_LEGEND,
    )
    return fig


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


def starvation_figure(
    results: Mapping[str, SimResult],
    request_id: str = "long",
    stream_ends_s: float | None = None,
    title: str | None = None,
) -> go.Figure:
    """Requests waiting over virtual time, one line per policy, with a ◆ where ``request_id`` got its first
    token and a ■ where it finished; ``stream_ends_s`` draws when the last request arrived."""
    fig = go.Figure()
    for i, (label, result) in enumerate(results.items()):
        color = COLORWAY[i % len(COLORWAY)]
        times = [s.start_s for s in result.steps]
        waiting = [s.num_waiting for s in result.steps]
        # At most ~500 points a line (every k-th step, and the last): the same picture, a fraction of the bytes.
        stride = max(1, -(-len(waiting) // 500))
        keep = sorted({*range(0, len(waiting), stride), len(waiting) - 1} - {-1})
        fig.add_trace(
            go.Scatter(
                x=[times[i] for i in keep],
                y=[waiting[i] for i in keep],
                name=f"{label}: waiting",
                line_shape="hv",
                line={"color": color, "dash": ("solid", "dash", "dot", "dashdot")[i % 4]},
                legendgroup=label,
            )
        )
        request = find_request(result, request_id)
        marks = [(request.metrics.token_times_s[0], "diamond", "first token"),
                 (request.metrics.finish_time_s, "square", "finished")]  # fmt: skip
        for t, symbol, what in marks:
            at = bisect.bisect_right(times, t) - 1  # the last step that began by then
            y = result.steps[at].num_waiting if at >= 0 else 0
            fig.add_trace(
                go.Scatter(
                    x=[t],
                    y=[y],
                    mode="markers",
                    name=f"{label}: {request_id} {what}",
                    legendgroup=label,
                    marker={"symbol": symbol, "size": 12, "color": color, "line": {"color": "black", "width": 1}},
                    hovertemplate=f"{label}: {request_id} {what} at %{{x:.2f}} s<extra></extra>",
                )
            )
    if stream_ends_s is not None:
        fig.add_vline(x=stream_ends_s, line_dash="dot", line_color="gray", annotation_text="last arrival")
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"Requests waiting, and when the {request_id} request ran (simulated)",
        xaxis_title="virtual time (s)",
        yaxis_title="requests waiting",
        legend=SIDE_LEGEND,
    )
    return fig


# --- the scheduling playground -----------------------------------------------------------------------------


def playground_policies(aging_tokens_per_step: float = 4.0) -> dict[str, str | Policy]:
    """The playground's choices: FCFS, static batching, shortest prompt first without and with aging."""
    return {
        "FCFS": "fcfs",
        "static batching": "static",
        "shortest prompt first, no aging": ShortestPromptFirst(aging_tokens_per_step=0.0),
        f"shortest prompt first, aging {aging_tokens_per_step:g}": ShortestPromptFirst(aging_tokens_per_step),
    }


@dataclass(frozen=True)
class Playground:
    """What the playground simulates besides its controls: the cost model, the engine's fixed knobs, the
    workload's shape and size, and the SLO goodput is measured against."""

    cost: StepCostModel
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_requests: int = 300
    workload: Mapping[str, Any] = field(default_factory=dict)  # mixed_workload's keyword arguments
    slo_target: slo.SLO = field(default_factory=lambda: slo.SLO(name="interactive", ttft_s=0.5, tpot_s=0.05))
    seed: int = 0


def playground_result(
    playground: Playground,
    policy: str | Policy,
    rate_rps: float,
    chunked_prefill: bool = True,
    num_kv_blocks: int | None = None,
) -> dict[str, float]:
    """The playground's whole callback: simulate the playground's workload at ``rate_rps`` under ``policy``, with
    chunked prefill on or off and ``num_kv_blocks`` KV blocks (default: the config's).

    Keys: everything :meth:`SimResult.summary` gives under the playground's SLO (``goodput_rps``,
    ``attainment``, ``throughput_rps``, TTFT/TPOT percentiles in ms, ``steps``, ``preemptions``…), the short
    and long requests' TTFT (:func:`class_summary`), ``max_step_tokens`` (the most tokens one step ran) and
    ``error`` (``""``, or why the simulation could not run, e.g. a request bigger than the whole KV cache).
    Invariants: ``goodput_rps ≤ throughput_rps``; the same arguments give the same numbers.
    """
    config = SchedulerConfig(
        **{
            **playground.config.__dict__,
            "scheduling_policy": policy,
            "enable_chunked_prefill": chunked_prefill,
            "num_kv_blocks": playground.config.num_kv_blocks if num_kv_blocks is None else num_kv_blocks,
        }
    )
    requests = mixed_workload(playground.num_requests, rate_rps, seed=playground.seed, **playground.workload)
    long_threshold = dict(playground.workload).get("long_prompt", (768, 1536))[0]
    try:
        result = Simulator(playground.cost, config).run(requests)
    except (ValueError, RuntimeError) as error:
        return {"error": str(error)}
    return {
        **result.summary(playground.slo_target),
        **class_summary(result, long_threshold),
        "max_step_tokens": max((s.features.num_tokens for s in result.steps), default=0),
        "error": "",
    }


def playground_html(result: Mapping[str, Any], slo_target: slo.SLO | None = None) -> str:
    """The playground's readout: a small HTML table of the simulated numbers."""
    if result.get("error"):
        return f"<p style='color:{SLO_COLOR}'>{result['error']}</p>"
    contract = ""
    if slo_target is not None:
        parts = [f"{k.upper()} ≤ {v * 1e3:g} ms" for k, v in slo_target.targets().items()]
        contract = " (" + ", ".join(parts) + ")"
    rows = [
        (f"goodput{contract}", f"{result['goodput_rps']:.2f} req/s ({result['attainment']:.0%} of requests)"),
        ("throughput", f"{result['throughput_rps']:.2f} req/s, {result['output_tokens_per_s']:,.0f} tokens/s"),
        ("TTFT p50 / p99", f"{result['ttft_p50_ms']:,.0f} / {result['ttft_p99_ms']:,.0f} ms"),
        ("short prompts: TTFT p50 / p99",
         f"{result['ttft_short_p50_ms']:,.0f} / {result['ttft_short_p99_ms']:,.0f} ms"),
        ("long prompts: TTFT p50 / longest",
         f"{result['ttft_long_p50_ms']:,.0f} / {result['ttft_long_max_ms']:,.0f} ms"),
        ("TPOT p50 / p99", f"{result['tpot_p50_ms']:.1f} / {result['tpot_p99_ms']:.1f} ms"),
        ("ITL p99", f"{result['itl_p99_ms']:.1f} ms"),
        ("steps, most tokens in one", f"{result['steps']:,}, {result['max_step_tokens']:,}"),
        ("preemptions", f"{result['preemptions']:,}"),
        ("simulated", f"{result['virtual_s']:.1f} s in {result['wall_s']:.2f} s"),
    ]  # fmt: skip
    body = "".join(
        f"<tr><td style='padding:0 12px'>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in rows
    )
    return f"<table>{body}</table>"


def scheduling_playground(
    playground: Playground,
    policies: Mapping[str, str | Policy] | None = None,
    rate_rps: float = 8.0,
    max_rate_rps: float = 20.0,
) -> widgets.VBox:
    """Policy, arrival rate, chunked prefill and KV blocks → the simulated TTFT, TPOT and goodput."""
    choices = dict(policies or playground_policies())
    policy = widgets.Dropdown(options=list(choices), value=next(iter(choices)), description="policy")
    rate = widgets.FloatSlider(
        value=rate_rps, min=0.5, max=max_rate_rps, step=0.5, description="rate req/s", continuous_update=False
    )
    chunked = widgets.Checkbox(value=playground.config.enable_chunked_prefill, description="chunked prefill")
    blocks = widgets.IntSlider(
        value=playground.config.num_kv_blocks,
        min=max(8, playground.config.num_kv_blocks // 32),
        max=playground.config.num_kv_blocks * 2,
        step=max(1, playground.config.num_kv_blocks // 64),
        description="KV blocks",
        continuous_update=False,
    )
    readout = widgets.HTML()
    controls = [policy, rate, chunked, blocks]

    def update(_change: object = None) -> None:
        result = playground_result(playground, choices[policy.value], rate.value, chunked.value, blocks.value)
        readout.value = playground_html(result, playground.slo_target)

    for control in controls:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls, readout])


__all__ = [
    "COMPARED",
    "QUICK_CALIBRATION",
    "SIDE_LEGEND",
    "STATE_COLORS",
    "EngineRun",
    "Playground",
    "batching_table",
    "capacity_rps",
    "chunked_prefill_figure",
    "class_summary",
    "find_request",
    "mixed_workload",
    "occupancy_figure",
    "occupancy_segments",
    "playground_html",
    "playground_policies",
    "playground_result",
    "policy_sweep",
    "requests_with_prompts",
    "run_engine",
    "scheduling_playground",
    "starvation_figure",
    "stream_with_long_request",
    "sweep_figure",
    "trace_table",
    "validation_figure",
    "validation_table",
    "waiting_running_figure",
]

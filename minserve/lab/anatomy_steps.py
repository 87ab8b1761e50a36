"""Chapter 02: the decode steps a trace recorded, by batch size, beside chapter 03's prediction of them.

In a trace every request of a step has a span of the step's forward pass (``prefill`` or ``decode``) and, if
the step sampled it a token, a ``sample`` span; all of them start at the same moment. :func:`decode_steps`
folds them back into one row per pure decode step: how many requests shared it (its batch), its forward
pass and sampling, and the whole step (its start to the next step's start: scheduling, detokenizing and
the rest included, which is what a streaming user waits between two tokens).

:func:`calibrate_decode` predicts that step from chapter 03's model, measured apart from the trace: pure
decode steps of the same engine at a few batch sizes (:func:`minserve.capacity.profiler.profile_decode`)
and a straight line through them (``fixed + per_sequence × batch``, the Theil–Sen fit of
:func:`minserve.capacity.decode_fit.decode_cost_fit`). Beside it, two readings of "the weights are read
once per step": the roofline's time to read them from memory at the measured bandwidth, and
:func:`weights_pass_s`, the time this machine takes to multiply one token through every weight matrix,
from wherever the weights sit (a small model's stay in the CPU's cache). Seconds unless a column says ms.

Timing on a shared machine: other processes only ever *add* time to a step, so where a handful of steps
must stand for a cost, the fastest of them counts (as the roofline's probe takes its best run).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd
import plotly.graph_objects as go
import torch

from minserve import capacity
from minserve.capacity import decode_fit, profiler
from minserve.capacity.roofline import Hardware
from minserve.lab.theme import COLORWAY, register_course_theme
from minserve.trace import TraceEvent

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


@dataclass(frozen=True)
class DecodeModel:
    """A whole decode step, predicted: ``fixed_s + per_sequence_s × batch`` (seconds).

    ``weights_s``: the roofline's time to read the weights once at the measured memory bandwidth.
    ``weights_pass_s``: one token multiplied through every weight matrix, measured (:func:`weights_pass_s`).
    ``bound_s``: the roofline's whole bound per calibrated batch size. ``calibration``: the measured
    (batch, seconds) points the line was fitted to, each the fastest of its steps.
    """

    fixed_s: float
    per_sequence_s: float
    weights_s: float
    weights_pass_s: float
    context_tokens: int
    bound_s: dict[int, float]
    calibration: tuple[tuple[int, float], ...]

    def predicted_s(self, batch: int) -> float:
        return self.fixed_s + self.per_sequence_s * batch


def weights_pass_s(llm: LLM, batch: int = 1, repeats: int = 30) -> float:
    """The fastest of ``repeats`` passes of ``batch`` rows through every weight matrix of the model (the
    matmuls of a decode step, the LM head included, and nothing else): what reading the weights once costs
    on this machine, from wherever they sit."""
    weights = [p for p in llm.model.parameters() if p.dim() == 2]
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for x, w in zip(inputs, weights):
                x @ w.T
            sync()
            best = min(best, time.perf_counter() - start)
    return best


def calibrate_decode(
    llm: LLM,
    hardware: Hardware,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    context: int = 32,
    steps: int = 8,
    rounds: int = 3,
) -> DecodeModel:
    """Measure pure decode steps of ``llm`` at each batch size, ``rounds`` sweeps over (about a second each on
    the embedded model), and fit the line to the fastest step of each batch size over all of them: a burst of
    load from another process can slow every step of one sweep, rarely of all. The engine must be idle; the
    profiler's requests land in its trace (clear it afterwards)."""
    sweeps = [profiler.profile_decode(llm, batch_sizes, (context,), steps, hardware) for _ in range(rounds)]
    fastest = tuple(
        dataclasses.replace(points[0], step_s=min(t for p in points for t in p.steps_s)) for points in zip(*sweeps)
    )
    profile = profiler.Profile(
        llm.engine.config.checkpoint.model, str(llm.device), _dtype(llm), hardware, (), fastest, 0.0
    )
    fit = decode_fit.decode_cost_fit(profile)
    weights = capacity.weights_read_bytes(llm.model_config, _dtype(llm)) / hardware.memory_bandwidth_bytes_per_s
    return DecodeModel(
        fixed_s=fit["fixed_s"],
        per_sequence_s=fit["per_sequence_s"],
        weights_s=weights,
        weights_pass_s=weights_pass_s(llm),
        context_tokens=context,
        bound_s={p.batch: p.predicted_s for p in fastest},
        calibration=tuple((p.batch, p.step_s) for p in fastest),
    )


def _dtype(llm: LLM) -> str:
    return str(llm.dtype).removeprefix("torch.")


def decode_steps(events: Iterable[TraceEvent]) -> pd.DataFrame:
    """One row per pure decode step in the trace (every request in it decoding), in time order.

    Columns: ``start_s``, ``batch`` (requests that shared the step), ``forward_ms`` (its decode span),
    ``sample_ms``, and ``step_ms``: its start to the next step's start (none for the trace's last step).
    Steps that also prefilled a prompt are left out: a prompt's tokens make them a different workload.
    """
    events = list(events)
    starts = sorted({e.start_s for e in events if e.name in ("prefill", "decode")})
    following = dict(itertools.pairwise(starts))
    prefill_starts = {e.start_s for e in events if e.name == "prefill"}
    samples = {e.start_s: e for e in events if e.name == "sample"}
    decodes: dict[float, list[TraceEvent]] = {}
    for e in events:
        if e.name == "decode" and e.start_s not in prefill_starts:
            decodes.setdefault(e.start_s, []).append(e)
    rows = []
    for start, spans in sorted(decodes.items()):
        sample = samples.get(spans[0].end_s)
        rows.append(
            {
                "start_s": start,
                "batch": len(spans),
                "forward_ms": spans[0].duration_s * 1e3,
                "sample_ms": sample.duration_s * 1e3 if sample is not None else 0.0,
                "step_ms": (following[start] - start) * 1e3 if start in following else float("nan"),
            }
        )
    return pd.DataFrame(rows, columns=["start_s", "batch", "forward_ms", "sample_ms", "step_ms"])


def step_prediction_table(steps: pd.DataFrame, model: DecodeModel) -> pd.DataFrame:
    """Per batch size in the trace: how many steps, the fastest whole step, the prediction, their ratio, the
    roofline's bound, and the two readings of the weights' cost (read from memory; one pass, measured)."""
    rows = []
    for batch, group in steps.dropna(subset=["step_ms"]).groupby("batch"):
        predicted_ms = model.predicted_s(int(batch)) * 1e3
        measured_ms = float(group["step_ms"].min())
        rows.append(
            {
                "batch": int(batch),
                "steps": len(group),
                "fastest step ms": measured_ms,
                "predicted ms": predicted_ms,
                "measured / predicted": measured_ms / predicted_ms,
                "roofline bound ms": _bound_s(model, int(batch)) * 1e3,
                "weights from memory ms": model.weights_s * 1e3,
                "weights pass ms": model.weights_pass_s * 1e3,
            }
        )
    return pd.DataFrame(rows).set_index("batch")


def _bound_s(model: DecodeModel, batch: int) -> float:
    """The roofline's bound at ``batch``: calibrated where measured, else the weights read (its floor)."""
    return model.bound_s.get(batch, model.weights_s)


def step_prediction_figure(steps: pd.DataFrame, model: DecodeModel, title: str | None = None) -> go.Figure:
    """Whole decode step against batch: every traced step, the fastest of each batch, the line predicted
    from the calibration, one sequence per step (``batch × step at 1``: the same tokens without batching),
    the roofline's bound and the measured pass through the weights."""
    largest = int(max(steps["batch"].max(), max(b for b, _ in model.calibration)))
    batches = list(range(1, largest + 1))
    table = step_prediction_table(steps, model)
    bounds = sorted(model.bound_s.items())
    fig = go.Figure()
    traces = [
        ("traced steps", steps["batch"], steps["step_ms"], "markers", {"color": COLORWAY[0], "opacity": 0.35}, {}),
        ("traced, fastest per batch", table.index, table["fastest step ms"], "markers",
         {"color": COLORWAY[0], "size": 12, "symbol": "diamond"}, {}),
        ("predicted: fixed + per sequence × batch", batches, [model.predicted_s(b) * 1e3 for b in batches],
         "lines", {}, {"color": COLORWAY[1], "width": 3}),
        ("calibration (profiler, fastest step)", [b for b, _ in model.calibration],
         [t * 1e3 for _, t in model.calibration], "markers", {"color": COLORWAY[1], "symbol": "x", "size": 9}, {}),
        ("one sequence per step (batch × step at 1)", batches, [b * model.predicted_s(1) * 1e3 for b in batches],
         "lines", {}, {"color": "gray", "dash": "dot"}),
        ("roofline bound (weights and KV from memory)", [b for b, _ in bounds], [t * 1e3 for _, t in bounds],
         "lines", {}, {"color": COLORWAY[2], "dash": "dash"}),
        ("one pass through the weights, measured", [1, largest], [model.weights_pass_s * 1e3] * 2, "lines", {},
         {"color": COLORWAY[5], "dash": "dashdot"}),
    ]  # fmt: skip
    for name, x, y, mode, marker, line in traces:
        fig.add_scatter(x=x, y=y, mode=mode, name=name, marker=marker or None, line=line or None)
    fig.update_layout(
        template=register_course_theme(),
        title=title or "A decode step against its batch: traced, predicted, and bounded",
        xaxis={"title": "batch (requests sharing the decode step)", "dtick": 1},
        yaxis={"title": "ms per decode step", "rangemode": "tozero"},
        legend={"orientation": "v", "y": 1, "x": 1.02, "xanchor": "left", "yanchor": "top"},
    )
    return fig

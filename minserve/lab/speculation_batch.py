"""Chapter 08 on a memory-bound model: the batch where speculation stops paying, predicted, then measured.

The prediction comes before the measurement and from other data: the acceptance rate α from held-out
requests (:func:`~minserve.capacity.speculation_runs.acceptance_rate` on a seed the sweep does not use), and
the verification step's cost v from this machine's roofline (its measured bandwidth and matmul peak), not
from the runs it predicts. :func:`predict` turns them into the roofline's speedup at every batch and the
batch past which it falls below 1; :func:`sweep` measures the speculative engine against the plain one at a
batch of one and past twice that batch; :func:`stop_paying_figure` draws both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from minserve.capacity.roofline import Hardware, critical_batch_size
from minserve.capacity.speculation import expected_tokens_per_step, roofline_speedup, roofline_stop_paying_batch
from minserve.capacity.speculation_runs import SpeculationPoint, compare, timed_run
from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.lab.theme import SLO_COLOR, register_course_theme
from minserve.model.config import ModelConfig

CURVE_BATCHES = tuple(2**i for i in range(9))  # 1 … 256 sequences


@dataclass(frozen=True)
class StopPrediction:
    """What the roofline expects of prompt lookup (c = 0) with k drafts at acceptance α, for ``model`` on
    ``hardware`` with ``context_tokens`` of KV per sequence.

    ``critical_batch`` is B* (the decode batch where the weight read stops being the bottleneck);
    ``stop_batch`` the largest batch at which the roofline's speedup is still ≥ 1, KV reads included."""

    model: ModelConfig
    hardware: Hardware
    acceptance: float
    k: int
    context_tokens: int
    stop_batch: int

    @property
    def critical_batch(self) -> float:
        return critical_batch_size(self.hardware, self.hardware.dtype)

    @property
    def tokens_per_step(self) -> float:
        return expected_tokens_per_step(self.acceptance, self.k)

    def at(self, batch: int) -> float:
        """The roofline's speedup at ``batch``: E[tokens per step] / v(batch)."""
        return roofline_speedup(self.model, self.hardware, self.acceptance, self.k, self.context_tokens, batch)


def predict(
    model: ModelConfig, hw: Hardware, acceptance: float, k: int, context_tokens: int, max_batch: int = 1 << 12
) -> StopPrediction:
    """Where the roofline says prompt lookup stops paying, from an α measured elsewhere."""
    stop = roofline_stop_paying_batch(model, hw, acceptance, k, context_tokens, max_batch=max_batch)
    return StopPrediction(model, hw, acceptance, k, context_tokens, stop)


def sweep_batches(stop_batch: int, max_batch: int = 32) -> tuple[int, ...]:
    """The batches to measure: 1, and past twice the predicted stop (at most ``max_batch``)."""
    return tuple(sorted({1, min(max_batch, max(2, math.ceil(2.1 * stop_batch)))}))


def sweep(
    plain: LLM,
    speculative: LLM,
    requests: Callable[[int, int], list],
    batches: Sequence[int],
    params: SamplingParams,
    requests_at_batch_one: int = 4,
    rounds: int = 2,
) -> list[SpeculationPoint]:
    """At each batch B: ``B`` requests (``requests(count, seed)``, the seed being B) sent together, plain and
    speculative, side by side (:func:`~minserve.capacity.speculation_runs.compare`), each the fastest of
    ``rounds`` runs: a run takes seconds, and one slowed by another process would flip a speedup near 1.
    At batch 1, ``requests_at_batch_one`` requests one after another."""
    points = []
    for batch in batches:
        prompts = requests(batch if batch > 1 else requests_at_batch_one, batch)
        reference = timed_run(plain, prompts, params, batch=batch, rounds=rounds)
        points.append(
            compare(reference, speculative, prompts, params, batch, workload="edit", proposer="ngram", rounds=rounds)
        )
    return points


def sweep_table(prediction: StopPrediction, points: Sequence[SpeculationPoint]) -> pd.DataFrame:
    """One row per measured batch: the roofline's speedup (held-out α), the run's own α, v and speedup."""
    rows = [
        {"batch": p.batch, "roofline speedup": prediction.at(p.batch), "α (this run)": p.acceptance,
         "v (this run)": p.verify_cost, "measured speedup": p.measured_speedup, "same tokens": p.same_output}
        for p in points
    ]  # fmt: skip
    return pd.DataFrame(rows).set_index("batch")


def stop_paying_figure(prediction: StopPrediction, points: Sequence[SpeculationPoint], title: str) -> go.Figure:
    """The roofline's speedup against the batch (log scale), the measured points on it, 1× and the stop."""
    fig = go.Figure()
    fig.add_scatter(
        x=CURVE_BATCHES, y=[prediction.at(b) for b in CURVE_BATCHES], mode="lines", name="roofline, held-out α",
        hovertemplate="batch %{x}: %{y:.2f}×<extra>roofline</extra>",
    )  # fmt: skip
    fig.add_scatter(
        x=[p.batch for p in points], y=[p.measured_speedup for p in points], mode="markers+text", name="measured",
        text=[f"{p.measured_speedup:.2f}×" for p in points], textposition="top center", marker={"size": 11},
    )  # fmt: skip
    fig.add_hline(y=1, line={"dash": "dot", "color": "grey"}, annotation_text="plain decoding")
    fig.add_vline(
        x=max(prediction.stop_batch, 1), line={"dash": "dash", "color": SLO_COLOR},
        annotation_text=f"stops paying: batch {prediction.stop_batch}",
    )  # fmt: skip
    fig.update_layout(
        title=title, xaxis={"title": "sequences per step", "type": "log"}, yaxis_title="speedup over plain (×)",
        template=register_course_theme(), height=420,
    )  # fmt: skip
    return fig

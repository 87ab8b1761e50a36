"""Chapter 08: where latency goes, what speculation should buy, what it bought, and whether it stayed exact.

* **Profile first**: :func:`phase_table` splits each request's latency into prefill (its TTFT) and decode
  (the rest); :func:`phase_figure` draws the split, so the lever is chosen for the phase that dominates.
* **The formula against the engine**: :func:`speedup_figure` draws
  :func:`~minserve.capacity.speculation.predicted_speedup` over k for an α, a draft cost c and a verification
  cost v, beside the points :mod:`minserve.capacity.speculation_runs` measured; :func:`speedup_explorer` is
  the same figure under three sliders.
* **Acceptance per position**: :func:`position_figure` draws what
  :func:`~minserve.capacity.speculation_runs.acceptance_by_position` counted in the trace.
* **Exactness**: :func:`first_token_counts` runs a verifier many times on a small vocabulary;
  :func:`verify_resampling_from_p` is the classic mistake to run it against; :func:`exactness_figure` draws
  the counts beside the target distribution.
* **The levers table**: :func:`levers_table`, what was measured here beside what a benchmark recorded.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import display

from minserve.capacity import levers
from minserve.capacity.levers import Lever
from minserve.capacity.speculation import predicted_speedup
from minserve.capacity.speculation_runs import SpeculationPoint
from minserve.engine.outputs import RequestOutput
from minserve.engine.speculative.rejection import Verdict
from minserve.lab.theme import SLO_COLOR, register_course_theme

Verifier = Callable[[list[int], torch.Tensor | None, torch.Tensor, torch.Generator], Verdict]

# --- profile first ------------------------------------------------------------------------------------------


def phase_table(outputs: Mapping[str, Sequence[RequestOutput]]) -> pd.DataFrame:
    """Per workload: mean prefill seconds (TTFT), mean decode seconds (the rest of the request), and the
    share of the latency each takes, with the phase that dominates named (:func:`levers.phase_split`)."""
    rows = []
    for workload, outs in outputs.items():
        split = levers.phase_split(outs)
        rows.append({
            "workload": workload, "requests": split.requests, "prefill ms": split.prefill_s * 1e3,
            "decode ms": split.decode_s * 1e3, "prefill share": split.prefill_share, "dominant": split.dominant,
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("workload")


def phase_figure(table: pd.DataFrame) -> go.Figure:
    """One stacked bar per workload: where its mean request's milliseconds went."""
    fig = go.Figure()
    for phase in ("prefill", "decode"):
        fig.add_bar(
            name=phase, y=table.index, x=table[f"{phase} ms"], orientation="h",
            hovertemplate=f"{phase}: %{{x:.0f}} ms<extra></extra>",
        )  # fmt: skip
    fig.update_layout(
        barmode="stack", title="Profile first: where a request's latency goes", xaxis_title="mean ms per request",
        template=register_course_theme(), height=260,
    )  # fmt: skip
    return fig


# --- the formula against the engine ------------------------------------------------------------------------


def points_table(points: Sequence[SpeculationPoint]) -> pd.DataFrame:
    return pd.DataFrame([p.row() for p in points])


def speedup_figure(
    acceptance: float,
    draft_cost: float,
    verify_cost: float = 1.0,
    points: Sequence[SpeculationPoint] = (),
    max_k: int = 8,
) -> go.Figure:
    """The predicted speedup for k = 1 … ``max_k`` at one α, c and v, beside measured ``points`` (their own
    α and c differ: hover for them). The break-even line is plain decoding."""
    ks = list(range(1, max_k + 1))
    fig = go.Figure()
    fig.add_scatter(
        x=ks, y=[predicted_speedup(acceptance, k, draft_cost, verify_cost) for k in ks], mode="lines+markers",
        name=f"predicted: α={acceptance:.2f}, c={draft_cost:.2f}, v={verify_cost:.2f}",
    )  # fmt: skip
    for label, group in _by_label(points).items():
        fig.add_scatter(
            x=[p.k for p in group], y=[p.measured_speedup for p in group], mode="markers", name=f"measured: {label}",
            marker={"size": 11, "symbol": "diamond"},
            text=[f"α={p.acceptance:.2f}, c={p.draft_cost:.2f}, v={p.verify_cost:.2f}" for p in group],
            hovertemplate="k=%{x}: %{y:.2f}× (%{text})<extra></extra>",
        )  # fmt: skip
    fig.add_hline(y=1.0, line_dash="dash", line_color=SLO_COLOR, annotation_text="plain decoding")
    fig.update_layout(
        title="Speedup over plain decoding", xaxis_title="k, tokens drafted per step", yaxis_title="speedup (×)",
        template=register_course_theme(), height=420,
    )  # fmt: skip
    return fig


def _by_label(points: Sequence[SpeculationPoint]) -> dict[str, list[SpeculationPoint]]:
    groups: dict[str, list[SpeculationPoint]] = {}
    for p in points:
        groups.setdefault(f"{p.proposer}, {p.workload}, batch {p.batch}", []).append(p)
    return groups


def speedup_explorer(points: Sequence[SpeculationPoint] = (), acceptance: float = 0.6) -> widgets.VBox:
    """α, c and v sliders above :func:`speedup_figure`, with the measured points fixed beneath the curve."""
    sliders = {
        "acceptance": widgets.FloatSlider(value=acceptance, min=0.0, max=0.99, step=0.01, description="α"),
        "draft_cost": widgets.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.01, description="draft cost c"),
        "verify_cost": widgets.FloatSlider(value=1.0, min=1.0, max=4.0, step=0.05, description="verify cost v"),
    }
    plot = widgets.Output()

    def update(_change: object = None) -> None:
        with plot:
            plot.clear_output(wait=True)
            display(speedup_figure(*(s.value for s in sliders.values()), points))

    for slider in sliders.values():
        slider.observe(update, names="value")
    update()
    return widgets.VBox([*sliders.values(), plot])


def prediction_figure(points: Sequence[SpeculationPoint]) -> go.Figure:
    """Measured speedup against each prediction (with v = 1, and with the measured v): on the diagonal, the
    formula was right."""
    fig = go.Figure()
    for column, name in (
        ("predicted_speedup", "predicted, v = 1"),
        ("predicted_with_verify_cost", "predicted, v measured"),
    ):
        fig.add_scatter(
            x=[getattr(p, column) for p in points], y=[p.measured_speedup for p in points], mode="markers", name=name,
            text=[f"{p.proposer}, {p.workload}, batch {p.batch}, k={p.k}" for p in points],
            hovertemplate="%{text}: predicted %{x:.2f}×, measured %{y:.2f}×<extra></extra>",
        )  # fmt: skip
    top = max([1.0, *(max(p.predicted_speedup, p.measured_speedup) for p in points)]) * 1.1
    fig.add_scatter(
        x=[0, top], y=[0, top], mode="lines", line={"dash": "dot", "color": "grey"}, name="measured = predicted"
    )
    fig.update_layout(
        title="The formula against the engine", xaxis_title="predicted speedup (×)", yaxis_title="measured speedup (×)",
        template=register_course_theme(), height=420,
    )  # fmt: skip
    return fig


def position_figure(acceptance: Mapping[str, Sequence[float | None]]) -> go.Figure:
    """Per proposer: the share of drafts kept at each position, among those the verifier reached."""
    fig = go.Figure()
    for label, shares in acceptance.items():
        fig.add_bar(name=label, x=list(range(1, len(shares) + 1)), y=[s if s is not None else 0 for s in shares])
    fig.update_layout(
        title="Acceptance by draft position", xaxis_title="draft position (1 = the first token drafted)",
        yaxis_title="kept, of those reached", yaxis_range=[0, 1], template=register_course_theme(), height=360,
    )  # fmt: skip
    return fig


# --- exactness -----------------------------------------------------------------------------------------------


def first_token_counts(
    verifier: Verifier, p: torch.Tensor, q: torch.Tensor, k: int, trials: int, seed: int = 0
) -> list[int]:
    """Run ``trials`` verification steps of ``k`` drafts sampled from ``q`` against a target ``p`` (the same
    at every position) and count the first token each emitted. A correct verifier's counts follow ``p``."""
    generator = torch.Generator().manual_seed(seed)
    counts = [0] * len(p)
    for _ in range(trials):
        drafts = [int(t) for t in torch.multinomial(q, k, replacement=True, generator=generator)]
        counts[verifier(drafts, q.expand(k, -1), p.expand(k + 1, -1), generator).tokens[0]] += 1
    return counts


def verify_resampling_from_p(
    draft_tokens: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """The classic mistake, for comparison only: on a rejection, sample again from p instead of the residual
    norm(max(p − q, 0)). The accepted drafts already supplied min(p, q) of the mass, so this over-weights the
    tokens the draft likes."""
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i][token])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * q_x < float(p[token]):
            continue
        return Verdict([*draft_tokens[:i], int(torch.multinomial(p, 1, generator=generator))], i)
    return Verdict([*draft_tokens, int(torch.multinomial(target_probs[-1], 1, generator=generator))], len(draft_tokens))


def exactness_figure(
    target: Sequence[float], counts: Mapping[str, Sequence[int]], title: str = "Emitted tokens against the target"
) -> go.Figure:
    """Each sampler's token frequencies as bars beside the target distribution (as a line of markers)."""
    fig = go.Figure()
    tokens = list(range(len(target)))
    for label, row in counts.items():
        total = sum(row)
        fig.add_bar(name=label, x=tokens, y=[c / total for c in row])
    fig.add_scatter(
        x=tokens, y=list(target), mode="markers", name="target p", marker={"size": 14, "symbol": "line-ew-open",
        "line": {"width": 3, "color": SLO_COLOR}},
    )  # fmt: skip
    fig.update_layout(
        title=title, xaxis_title="token", yaxis_title="frequency", template=register_course_theme(), height=380
    )
    return fig


def most_common_tokens(outputs: Sequence[RequestOutput], positions: slice, n: int) -> list[int]:
    """The ``n`` tokens seen most often at ``positions`` of the outputs' tokens, most frequent first."""
    seen = Counter(t for out in outputs for t in out.token_ids[positions])
    return [token for token, _ in seen.most_common(n)]


def token_counts(outputs: Sequence[RequestOutput], positions: slice, vocabulary: Sequence[int]) -> list[int]:
    """How often each token of ``vocabulary`` appears at ``positions`` of the outputs' tokens; every other
    token counts in one last category (so the counts always sum to the tokens seen)."""
    seen = Counter(t for out in outputs for t in out.token_ids[positions])
    listed = [seen.get(t, 0) for t in vocabulary]
    return [*listed, sum(seen.values()) - sum(listed)]


# --- the levers table ----------------------------------------------------------------------------------------

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def levers_table(measured: Sequence[Lever], results_dir: Path = RESULTS_DIR) -> pd.DataFrame:
    """The levers measured in this notebook, then those ``benchmarks/levers.py`` recorded (its newest
    ``levers-*.json``: torch.compile, and the GPU-only ones when a GPU ran it), each marked with its source."""
    rows = [{**lever.row(), "source": "measured here"} for lever in measured]
    files = sorted(results_dir.glob("levers-*.json"))
    if files:
        recorded = json.loads(files[-1].read_text())
        rows += [{**row, "source": f"recorded: {files[-1].name}"} for row in recorded.get("rows", [])]
    else:
        rows.append(
            {
                "lever": "torch.compile, Triton attention, CUDA graphs",
                "note": "not recorded yet: run benchmarks/levers.py (the last two need a GPU)",
                "source": "no benchmarks/results/levers-*.json",
            }
        )
    return pd.DataFrame(rows).set_index("lever")

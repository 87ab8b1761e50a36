"""Chapter 06's parallelism planner: a table and a figure of every layout of N GPUs, and the widget on them;
and the question before any layout, which models need more than one GPU (:func:`memory_fit_table`).

The numbers come from :mod:`minserve.capacity.parallel` (the same as ``minserve plan parallel`` prints);
:func:`planner_table` arranges them into a DataFrame, :func:`planner_figure` draws it, and
:func:`parallelism_planner` only wires controls to the two. Times are in ms, memory in GB (10⁹ bytes).
"""

from __future__ import annotations

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import capacity
from minserve.capacity import parallel
from minserve.capacity.interconnect import INTERCONNECTS, Interconnect, interconnect
from minserve.capacity.kv import ModelLike, model_config
from minserve.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION, estimate_params
from minserve.capacity.roofline import HARDWARE, Hardware
from minserve.lab.theme import COLORWAY, SLO_COLOR, register_course_theme

# The stacked terms of a step, in the order drawn, and their colours (the roof's two share one: only one binds).
TERMS = {"work ms": COLORWAY[0], "communication ms": COLORWAY[1], "bubble ms": COLORWAY[3]}
NO_FIT_COLOR = "#BBBBBB"


def planner_table(
    model: ModelLike,
    gpu: str | Hardware,
    gpus: int,
    link: str | Interconnect,
    batch: int,
    context_tokens: int,
    dtype: str | None = None,
    micro_batches: int | None = None,
) -> pd.DataFrame:
    """One row per layout of ``gpus`` GPUs (most tensor parallelism first) at ``batch`` sequences per replica.

    Columns: ``layout``, ``TP``, ``PP``, ``DP``, ``micro-batches``, ``fits``, ``weights GB/GPU``,
    ``KV tokens/GPU``, ``compute ms``, ``memory ms``, ``work ms`` (the larger of the two), ``communication ms``,
    ``bubble ms``, ``ms/token`` (their sum: the step), ``tok/s/replica``, ``tok/s`` (all replicas) and
    ``dominant``. Invariant: ``ms/token = work + communication + bubble``.
    """
    hw = gpu if isinstance(gpu, Hardware) else capacity.hardware(gpu)
    link = link if isinstance(link, Interconnect) else interconnect(link)
    plans = parallel.plan_parallel(model, hw, gpus, link, batch, context_tokens, dtype, micro_batches=micro_batches)
    rows = [
        {
            "layout": plan.layout.name,
            "TP": plan.layout.tensor_parallel_size,
            "PP": plan.layout.pipeline_parallel_size,
            "DP": plan.layout.data_parallel_size,
            "micro-batches": plan.micro_batches,
            "fits": plan.fits,
            "weights GB/GPU": plan.weights_bytes_per_gpu / 1e9,
            "KV tokens/GPU": plan.kv_tokens_per_gpu,
            "compute ms": plan.compute_s * 1e3,
            "memory ms": plan.memory_s * 1e3,
            "work ms": plan.work_s * 1e3,
            "communication ms": plan.communication_s * 1e3,
            "bubble ms": plan.bubble_s * 1e3,
            "ms/token": plan.step_s * 1e3,
            "tok/s/replica": plan.tokens_per_s_per_replica,
            "tok/s": plan.tokens_per_s,
            "dominant": plan.dominant,
        }
        for plan in plans
    ]
    return pd.DataFrame(rows)


def planner_figure(table: pd.DataFrame, title: str = "") -> go.Figure:
    """Left: each layout's time per output token, stacked as work (the binding roof), communication and
    pipeline bubble. Right: its total tokens/s. Layouts that do not fit are grey on the right and marked."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time per output token", "throughput, all replicas"))
    labels = [name if fits else f"{name} (no fit)" for name, fits in zip(table["layout"], table["fits"])]
    for term, color in TERMS.items():
        fig.add_trace(
            go.Bar(
                x=labels,
                y=table[term],
                name=term.removesuffix(" ms"),
                marker_color=color,
                customdata=table["dominant"],
                hovertemplate=f"%{{x}}<br>{term}: %{{y:.3g}}<br>dominant: %{{customdata}}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    fig.add_trace(
        go.Bar(
            x=labels,
            y=table["tok/s"],
            name="tokens/s",
            marker_color=[COLORWAY[2] if fits else NO_FIT_COLOR for fits in table["fits"]],
            hovertemplate="%{x}<br>%{y:,.0f} tokens/s<extra></extra>",
            showlegend=False,
        ),
        row=1,
        col=2,
    )
    fig.update_layout(template=register_course_theme(), barmode="stack", title=title)
    fig.update_yaxes(title_text="ms per token", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=2)
    return fig


def parallelism_planner(
    model: str = "Llama-3-70B",
    gpu: str = "H100",
    gpus: int = 8,
    link: str = "nvlink4",
    batch: int = 1,
    context_tokens: int = 4096,
) -> widgets.VBox:
    """Model, GPU, GPU count, interconnect, batch and context controls above the planner's figure and table.
    Every choice has a layout (one GPU's share always splits: TP1), so nothing here can fail."""
    choice = widgets.Dropdown(options=list(capacity.MODEL_PRESETS), value=model, description="model")
    gpu_box = widgets.Dropdown(options=list(HARDWARE), value=gpu, description="GPU")
    count = widgets.Dropdown(options=[1, 2, 4, 8, 16], value=gpus, description="GPUs")
    link_box = widgets.Dropdown(options=list(INTERCONNECTS), value=link, description="link")
    batch_box = widgets.IntText(value=batch, description="batch")
    context = widgets.IntText(value=context_tokens, description="context")
    figure, readout = widgets.Output(), widgets.HTML()
    controls = [choice, gpu_box, count, link_box, batch_box, context]

    def update(_change: object = None) -> None:
        result = planner_table(choice.value, gpu_box.value, count.value, link_box.value,
                               max(batch_box.value, 1), max(context.value, 1))  # fmt: skip
        readout.value = planner_summary_html(result)
        figure.clear_output(wait=True)
        with figure:
            planner_figure(result, f"{choice.value} on {count.value} × {gpu_box.value}").show()

    for control in controls:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls, figure, readout])


def planner_summary_html(table: pd.DataFrame) -> str:
    """The planner's table as HTML, the columns a reader compares first, rounded."""
    columns = ["layout", "fits", "weights GB/GPU", "KV tokens/GPU", "ms/token", "tok/s", "dominant"]
    return table[columns].round(2).to_html(index=False, border=0)


# --- memory first: which models need more than one GPU -------------------------------------------------------


def memory_fit_table(
    models: list[str],
    gpu: str = "H100",
    sizes: tuple[int, ...] = (1, 2, 4, 8),
    context_tokens: int = 4096,
    dtype: str = "bfloat16",
) -> pd.DataFrame:
    """One row per model and tensor-parallel size: what one GPU holds, and how many sequences of
    ``context_tokens`` its KV room takes beside the weights.

    Columns: ``model``, ``params (B)`` (every expert of a mixture counted: all of them take memory),
    ``TP``, ``weights GB/GPU``, ``usable GB`` (the GPU's memory × vLLM's default 0.9), ``weights fit``,
    ``KV tokens/GPU`` and ``sequences`` (of ``context_tokens`` each; 0 when the weights do not fit). From
    :func:`minserve.capacity.parallel.plan_layout`, the planner's own arithmetic.
    """
    hw = capacity.hardware(gpu)
    link = INTERCONNECTS["nvlink4"]  # memory does not depend on the link; plan_layout needs one
    usable = int(hw.memory_bytes * DEFAULT_GPU_MEMORY_UTILIZATION)
    rows = []
    for model in models:
        params = estimate_params(model_config(model))
        for size in sizes:
            plan = parallel.plan_layout(model, parallel.Layout(size), hw, link, 1, context_tokens, dtype)
            weights_fit = plan.weights_bytes_per_gpu <= usable
            rows.append({
                "model": model,
                "params (B)": params / 1e9,
                "TP": size,
                "weights GB/GPU": plan.weights_bytes_per_gpu / 1e9,
                "usable GB": usable / 1e9,
                "weights fit": weights_fit,
                "KV tokens/GPU": plan.kv_tokens_per_gpu if weights_fit else 0,
                "sequences": plan.kv_tokens_per_gpu // context_tokens if weights_fit else 0,
            })  # fmt: skip
    return pd.DataFrame(rows)


def memory_fit_figure(table: pd.DataFrame, title: str = "") -> go.Figure:
    """Weights per GPU against the tensor-parallel size, one line per model, the usable memory as a line:
    a point above it does not fit, and the distance below it is the KV cache's room."""
    fig = go.Figure()
    for model, rows in table.groupby("model", sort=False):
        fig.add_scatter(
            x=rows["TP"],
            y=rows["weights GB/GPU"],
            name=model,
            mode="lines+markers",
            customdata=rows[["KV tokens/GPU", "sequences"]],
            hovertemplate="TP%{x}: %{y:.1f} GB of weights a GPU<br>KV room: %{customdata[0]:,} tokens, "
            "%{customdata[1]} sequences<extra>" + str(model) + "</extra>",
        )
    usable = float(table["usable GB"].iloc[0])
    fig.add_hline(y=usable, line_dash="dash", line_color=SLO_COLOR, annotation_text=f"usable: {usable:.0f} GB")
    fig.update_layout(template=register_course_theme(), title=title, xaxis_title="tensor-parallel size (GPUs)",
                      yaxis_title="weights per GPU (GB)", yaxis_type="log", xaxis_type="log")  # fmt: skip
    fig.update_xaxes(tickvals=sorted(table["TP"].unique()))
    return fig


def tensor_parallel_scaling(
    model: ModelLike,
    gpu: str = "H100",
    links: tuple[str, ...] = ("nvlink4", "pcie4"),
    sizes: tuple[int, ...] = (2, 4, 8),
    batch: int = 1,
    context_tokens: int = 4096,
) -> pd.DataFrame:
    """A decode step of ``batch`` sequences under tensor parallelism alone, per link and size: the roofline's
    work on one GPU's share, the collectives (ring model), their sum (ms per output token) and the speed-up
    over the smallest size. From :func:`minserve.capacity.parallel.plan_layout`."""
    hw = capacity.hardware(gpu)
    rows = []
    for name in links:
        link = interconnect(name)
        plans = [parallel.plan_layout(model, parallel.Layout(size), hw, link, batch, context_tokens) for size in sizes]
        for size, plan in zip(sizes, plans):
            rows.append({
                "link": link.name,
                "TP": size,
                "fits": plan.fits,
                "work ms": plan.work_s * 1e3,
                "communication ms": plan.communication_s * 1e3,
                "ms/token": plan.step_s * 1e3,
                f"speed-up over TP{sizes[0]}": plans[0].step_s / plan.step_s,
            })  # fmt: skip
    return pd.DataFrame(rows)

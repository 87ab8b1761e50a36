"""Chapter 04: KV-cache tables and figures.

Pure functions (:func:`kv_per_token_table`, :func:`context_concurrency_grid_gb`, :func:`fragmentation_table`)
do the arithmetic through :mod:`minserve.capacity`; the figure functions draw those tables and what the
experiments of :mod:`minserve.lab.kv_experiments` measured, beside the predictions of
:mod:`minserve.lab.kv_checks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import capacity
from minserve.capacity.kv import ModelLike
from minserve.lab.theme import SLO_COLOR, register_course_theme

GB = 1e9


# --- arithmetic tables ----------------------------------------------------------------------------------------


def kv_per_token_table(
    published: Mapping[str, int], dtype: str = "bfloat16", context_tokens: int = 4096
) -> pd.DataFrame:
    """Per preset: the shape that sets KV size, bytes per token computed vs ``published``, one request's GB."""
    rows = []
    for name, expected in published.items():
        hf = capacity.model_preset(name)
        per_token = capacity.kv_bytes_per_token_preset(name, dtype)
        heads = int(hf["num_attention_heads"])
        rows.append(
            {
                "model": name,
                "layers": int(hf["num_hidden_layers"]),
                "query heads": heads,
                "KV heads": int(hf.get("num_key_value_heads") or heads),
                "head_dim": int(hf.get("head_dim") or hf["hidden_size"] // heads),
                "bytes/token": per_token,
                "published": expected,
                f"GB per {context_tokens}-token request": per_token * context_tokens / GB,
            }
        )
    return pd.DataFrame(rows).set_index("model")


def context_concurrency_grid_gb(
    model: ModelLike, contexts_tokens: Sequence[int], concurrencies: Sequence[int], dtype: str = "bfloat16"
) -> pd.DataFrame:
    """KV GB for every (concurrency, context) pair: rows are concurrencies, columns contexts."""
    config = capacity.model_config(model)
    data = [[capacity.kv_bytes_total(config, c, n, dtype) / GB for c in contexts_tokens] for n in concurrencies]
    return pd.DataFrame(data, index=list(concurrencies), columns=list(contexts_tokens))


def context_concurrency_heatmap(
    model: ModelLike,
    contexts_tokens: Sequence[int],
    concurrencies: Sequence[int],
    dtype: str = "bfloat16",
    budget_gb: float | None = None,
    title: str | None = None,
) -> go.Figure:
    """Heatmap of KV GB over context × concurrency; cells over ``budget_gb`` are marked with ✗."""
    grid = context_concurrency_grid_gb(model, contexts_tokens, concurrencies, dtype)
    text = [
        [f"{v:.0f}" + (" ✗" if budget_gb is not None and v > budget_gb else "") for v in row] for row in grid.values
    ]
    fig = go.Figure(
        go.Heatmap(
            z=grid.values,
            x=[str(c) for c in grid.columns],
            y=[str(n) for n in grid.index],
            text=text,
            texttemplate="%{text}",
            colorscale="Blues",
            colorbar_title="KV GB",
            hovertemplate="context %{x}<br>concurrency %{y}<br>%{z:.1f} GB<extra></extra>",
        )
    )
    name = model if isinstance(model, str) else "model"
    budget = f"; ✗ = over {budget_gb:.0f} GB" if budget_gb is not None else ""
    fig.update_layout(
        template=register_course_theme(),
        title=title or f"{name}, {dtype}: KV cache GB = context × concurrency × bytes/token{budget}",
        xaxis_title="context length (tokens)",
        yaxis_title="concurrent sequences",
    )
    return fig


def fragmentation_table(seq_lens_tokens: Sequence[int], block_sizes: Sequence[int]) -> pd.DataFrame:
    """Internal fragmentation per block size: wasted slots per sequence (mean, max) and the wasted share.

    Invariant: ``max wasted/seq`` < ``block_size``: only a sequence's last block is ever partly empty.
    """
    rows = []
    for bs in block_sizes:
        waste = [capacity.wasted_slots(n, bs) for n in seq_lens_tokens]
        allocated = sum(capacity.blocks_per_sequence(n, bs) for n in seq_lens_tokens) * bs
        rows.append(
            {
                "block_size": bs,
                "mean wasted/seq": sum(waste) / len(waste),
                "max wasted/seq": max(waste),
                "wasted share": sum(waste) / allocated if allocated else 0.0,
            }
        )
    return pd.DataFrame(rows).set_index("block_size")


# --- figures ----------------------------------------------------------------------------------------------------


def reserved_vs_used_figure(
    usage: pd.DataFrame, block_size: int, max_model_len: int, predicted_blocks: pd.Series | None = None
) -> go.Figure:
    """Token slots per step: a contiguous reservation (``max_model_len`` per running sequence) vs paged blocks
    vs the tokens actually stored; ``predicted_blocks`` (per step, as ``usage``) is drawn as ◇ markers."""
    contiguous = usage["running"] * max_model_len
    paged = usage["used_blocks"] * block_size
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=usage["step"], y=contiguous, name=f"contiguous: {max_model_len} slots/sequence"))
    fig.add_trace(go.Scatter(x=usage["step"], y=paged, name=f"paged: blocks of {block_size} in use", line_shape="hv"))
    if predicted_blocks is not None:
        fig.add_trace(
            go.Scatter(
                x=usage["step"],
                y=predicted_blocks * block_size,
                mode="markers",
                marker={"symbol": "diamond-open", "size": 7},
                name=f"predicted: Σ⌈tokens / {block_size}⌉ blocks",
            )
        )
    fig.add_trace(go.Scatter(x=usage["step"], y=usage["stored_tokens"], name="tokens actually stored", line_dash="dot"))
    fig.update_layout(
        template=register_course_theme(),
        title="KV slots held per step: reserving the maximum vs paging on demand",
        xaxis_title="engine step",
        yaxis_title="token slots",
        yaxis_type="log",
    )
    return fig


def admission_figure(usage: pd.DataFrame, num_blocks: int, predicted_admitted: int | None = None) -> go.Figure:
    """Running and waiting requests per step (top) and KV blocks in use against the pool (bottom);
    ``predicted_admitted`` is drawn as a ◇ at the first step."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    if predicted_admitted is not None:
        fig.add_trace(
            go.Scatter(
                x=[usage["step"].iloc[0]],
                y=[predicted_admitted],
                mode="markers",
                marker={"symbol": "diamond-open", "size": 12, "color": SLO_COLOR},
                name="predicted running at the first step",
            ),
            row=1,
            col=1,
        )
    fig.add_trace(go.Scatter(x=usage["step"], y=usage["running"], name="running", line_shape="hv"), row=1, col=1)
    fig.add_trace(go.Scatter(x=usage["step"], y=usage["waiting"], name="waiting", line_shape="hv"), row=1, col=1)
    fig.add_trace(
        go.Scatter(
            x=usage["step"], y=usage["preemptions"], name="preemptions (total)", line_shape="hv", line_dash="dot"
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(x=usage["step"], y=usage["used_blocks"], name="KV blocks used", line_shape="hv"), row=2, col=1
    )
    fig.add_hline(
        y=num_blocks,
        line_dash="dash",
        line_color=SLO_COLOR,
        row=2,
        col=1,
        annotation_text=f"pool: {num_blocks} blocks",
        annotation_position="bottom right",
    )
    fig.update_layout(
        template=register_course_theme(), title="Memory pressure: admission waits for free blocks", height=520
    )
    fig.update_yaxes(title_text="requests", row=1, col=1)
    fig.update_yaxes(title_text="blocks", row=2, col=1)
    fig.update_xaxes(title_text="engine step", row=2, col=1)
    return fig


def prefix_cache_figure(
    ttft_ms: Mapping[str, Sequence[float]], hit_rates: Mapping[str, float], predicted_hit_rate: float | None = None
) -> go.Figure:
    """TTFT of each request (in arrival order), one line per setting, measured hit rates in the legend and the
    predicted one (with the cache on) in the title."""
    fig = go.Figure()
    for name, values in ttft_ms.items():
        label = f"{name} (hit rate {hit_rates.get(name, 0.0):.0%})"
        fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)), y=list(values), mode="lines+markers", name=label))
    fig.update_layout(
        template=register_course_theme(),
        title="A shared system prompt: TTFT per request, prefix cache on vs off"
        + ("" if predicted_hit_rate is None else f" (predicted hit rate {predicted_hit_rate:.0%})"),
        xaxis_title="request (in arrival order)",
        yaxis_title="TTFT (ms)",
        yaxis_rangemode="tozero",
    )
    return fig


def eviction_figure(
    sweep: pd.DataFrame, predicted_cached_tokens: Sequence[int], pool_blocks: int, prompt_tokens: int
) -> go.Figure:
    """The cached prompt's hit rate against the new traffic since it was last used (blocks handed out):
    measured ● and predicted (line), with the pool's size marked: past it, the pool has cycled."""
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=sweep["filler_blocks"],
            y=[c / prompt_tokens for c in predicted_cached_tokens],
            name="predicted (LRU)",
            line_dash="dash",
        )
    )
    fig.add_trace(
        go.Scatter(x=sweep["filler_blocks"], y=sweep["hit_rate"], mode="markers", name="measured", marker_size=9)
    )
    fig.add_vline(x=pool_blocks, line_dash="dot", line_color=SLO_COLOR, annotation_text=f"pool: {pool_blocks} blocks")
    fig.update_layout(
        template=register_course_theme(),
        title="Eviction: a cached prompt's hit rate as new traffic cycles through the pool",
        xaxis_title="KV blocks handed to new requests since the prompt was last used",
        yaxis_title="hit rate of the prompt",
        yaxis_tickformat=".0%",
        yaxis_rangemode="tozero",
    )
    return fig

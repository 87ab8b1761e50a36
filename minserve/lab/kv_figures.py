"""Chapter 04: KV-cache tables and figures, and a sampler that watches the engine's blocks step by step.

Pure functions (:func:`kv_per_token_table`, :func:`context_concurrency_grid_gb`, :func:`fragmentation_table`)
do the arithmetic through :mod:`minserve.capacity`; :func:`sample_kv_usage` drives an engine one
``step()`` at a time and records its memory; the figure functions only draw those tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minserve import capacity
from minserve.capacity.kv import ModelLike
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams
from minserve.lab.theme import SLO_COLOR, register_course_theme

if TYPE_CHECKING:
    from minserve.engine.llm import LLM

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


# --- measuring the engine -------------------------------------------------------------------------------------


def sample_kv_usage(
    llm: LLM, prompts: Sequence[str], params: SamplingParams | Sequence[SamplingParams], max_steps: int = 100_000
) -> tuple[pd.DataFrame, list[RequestOutput]]:
    """Queue ``prompts``, drive ``llm.engine.step()`` until all finish, and record the KV cache after each step.

    Returns one row per step (``step``, ``used_blocks``, ``stored_tokens``: tokens whose KV is in the cache,
    ``running``, ``waiting``, ``preemptions``, ``finished``) and the final outputs in prompt order.
    """
    engine = llm.engine
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    finished: dict[str, RequestOutput] = {}
    rows = []
    for step in range(1, max_steps + 1):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        stats = engine.stats()
        rows.append(
            {
                "step": step,
                "used_blocks": stats.kv_blocks_used,
                "stored_tokens": sum(s.num_computed_tokens for s in engine.scheduler.running),
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "preemptions": stats.num_preemptions,
                "finished": sum(rid in finished for rid in ids),
            }
        )
        if len(finished) == len(ids):
            break
    return pd.DataFrame(rows), [finished[rid] for rid in ids if rid in finished]


# --- figures ----------------------------------------------------------------------------------------------------


def reserved_vs_used_figure(usage: pd.DataFrame, block_size: int, max_model_len: int) -> go.Figure:
    """Token slots per step: a contiguous reservation (``max_model_len`` per running sequence) vs paged blocks
    vs the tokens actually stored."""
    contiguous = usage["running"] * max_model_len
    paged = usage["used_blocks"] * block_size
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=usage["step"], y=contiguous, name=f"contiguous: {max_model_len} slots/sequence"))
    fig.add_trace(go.Scatter(x=usage["step"], y=paged, name=f"paged: blocks of {block_size} in use", line_shape="hv"))
    fig.add_trace(go.Scatter(x=usage["step"], y=usage["stored_tokens"], name="tokens actually stored", line_dash="dot"))
    fig.update_layout(
        template=register_course_theme(),
        title="KV slots held per step: reserving the maximum vs paging on demand",
        xaxis_title="engine step",
        yaxis_title="token slots",
        yaxis_type="log",
    )
    return fig


def admission_figure(usage: pd.DataFrame, num_blocks: int) -> go.Figure:
    """Running and waiting requests per step (top) and KV blocks in use against the pool (bottom)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
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


def prefix_cache_figure(ttft_ms: Mapping[str, Sequence[float]], hit_rates: Mapping[str, float]) -> go.Figure:
    """TTFT of each request (in arrival order), one line per setting, hit rates in the legend."""
    fig = go.Figure()
    for name, values in ttft_ms.items():
        label = f"{name} (hit rate {hit_rates.get(name, 0.0):.0%})"
        fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)), y=list(values), mode="lines+markers", name=label))
    fig.update_layout(
        template=register_course_theme(),
        title="A shared system prompt: TTFT per request, prefix cache on vs off",
        xaxis_title="request (in arrival order)",
        yaxis_title="TTFT (ms)",
        yaxis_rangemode="tozero",
    )
    return fig

"""Chapter 07's views: formats' round trips, decode speed against bytes, quality against bits, and an
explorer of the measured trade-offs. The measuring lives in :mod:`minserve.quant`,
:mod:`minserve.quality.quantized` and :mod:`minserve.capacity.format_runs`; this module shapes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from minserve.engine.llm import LLM
from minserve.quant.formats import QuantizedWeight, max_round_trip_error, quantize
from minserve.quant.swap import DEFAULT_GROUP_SIZE, QuantScheme

CHAT_MODEL = "smollm2-135m-instruct"


def round_trip_table(weight: torch.Tensor, labels: Sequence[str]) -> pd.DataFrame:
    """Per weight format: bits per weight as stored, the largest error over its bound (≤ 1 means every
    element came back within half a step), and the mean error relative to the weights' spread."""
    rows = []
    spread = float(weight.float().std())
    for label in labels:
        scheme = QuantScheme.from_label(label)
        q = scheme_quantize(weight, scheme)
        error = (q.dequantize() - weight.float()).abs()
        rows.append({
            "format": label,
            "bits/weight": 8 * q.nbytes / weight.numel(),
            "worst error / bound": float((error / max_round_trip_error(q, weight)).max()),
            "mean error / std": float(error.mean()) / spread,
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("format")


def scheme_quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """``weight`` in the scheme's format (int4 in its group size, or the default one)."""
    return quantize(weight, scheme.format, scheme.group_size or DEFAULT_GROUP_SIZE)


def error_figure(weight: torch.Tensor, labels: Sequence[str]) -> go.Figure:
    """Histograms of the round-trip error of each format, in units of the weights' standard deviation."""
    spread = float(weight.float().std())
    fig = go.Figure()
    for label in labels:
        q = scheme_quantize(weight, QuantScheme.from_label(label))
        error = ((q.dequantize() - weight.float()) / spread).flatten()
        fig.add_histogram(x=error[:: max(1, len(error) // 20_000)].numpy(), name=label, opacity=0.6, nbinsx=120)
    fig.update_layout(barmode="overlay", xaxis_title="round-trip error (× the weights' std)", yaxis_title="weights")
    return fig


def speed_figure(speed: pd.DataFrame) -> go.Figure:
    """Measured single-stream tokens/s against MB read per step, with the roofline's bound beside it."""
    fig = go.Figure()
    fig.add_scatter(x=speed["read per step (MB)"], y=speed["tokens/s"], mode="markers+text", text=speed.index,
                    textposition="top center", name="measured")  # fmt: skip
    fig.add_scatter(x=speed["read per step (MB)"], y=speed["roofline tokens/s"], mode="markers", name="roofline",
                    marker_symbol="triangle-up")  # fmt: skip
    fig.update_layout(xaxis_title="weights read per decode step (MB)", yaxis_title="tokens/s, one stream",
                      yaxis_type="log", xaxis_type="log")  # fmt: skip
    return fig


def kl_figure(quality: pd.DataFrame) -> go.Figure:
    """KL divergence from float32 against bits per weight, one point per format (log scale: KL spans decades)."""
    rows = quality.drop(index="float32", errors="ignore")
    fig = go.Figure(go.Scatter(x=rows["bits/weight"], y=rows["KL (nats/token)"].clip(lower=1e-6), mode="markers+text",
                               text=rows.index, textposition="top center"))  # fmt: skip
    fig.update_layout(xaxis_title="bits per weight (linear layers)", yaxis_title="KL from float32 (nats/token)",
                      yaxis_type="log")  # fmt: skip
    return fig


def allocated_kv_bytes(llm: LLM) -> int:
    """Bytes of every tensor the engine allocated for its KV cache: the codes (or floats) of every layer,
    and an 8-bit cache's scales. Read off the tensors themselves, not computed from dtype sizes."""
    engine = llm.engine
    tensors = list(engine.runner.kv_caches) + list(engine.kv_scales or [])
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_capacity_table(
    model: str, budget_bytes: int, kv_dtypes: Sequence[str] = ("auto", "int8", "fp8")
) -> pd.DataFrame:
    """Tokens the same KV memory holds in each cache format, from the engine's own block counts, and the
    bytes per cached token the engine really allocated (codes and scales over the tokens they hold)."""
    rows = []
    for kv_dtype in kv_dtypes:
        llm = LLM(model, kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=budget_bytes, enable_tracing=False,
                  quantization="none")  # fmt: skip
        stats, block = llm.stats(), llm.engine.config.scheduler.block_size
        tokens = stats["kv_blocks_total"] * block
        rows.append({
            "KV cache": kv_dtype if kv_dtype != "auto" else str(llm.dtype).removeprefix("torch."),
            "blocks": stats["kv_blocks_total"],
            "tokens": tokens,
            "allocated (MiB)": allocated_kv_bytes(llm) / 2**20,
            "allocated bytes/token": allocated_kv_bytes(llm) / tokens,
        })  # fmt: skip
        del llm
    return pd.DataFrame(rows).set_index("KV cache")


KERNEL_OF = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int4-g32"}  # engine format → its kernel


def kernel_rates(streaming: pd.DataFrame, layer: str, kernel_of: dict[str, str] = KERNEL_OF) -> dict[str, float]:
    """GB/s each engine format's one-row kernel streamed ``layer``'s weight at (``kernel_streaming``'s table)."""
    return {f: float(streaming.loc[(layer, k), "GB/s"]) for f, k in kernel_of.items()}


def streaming_figure(streaming: pd.DataFrame, bandwidth_bytes_per_s: float) -> go.Figure:
    """GB/s each kernel streamed its weight at, one bar per kernel, beside the measured memory bandwidth."""
    rows = streaming.reset_index()
    fig = go.Figure(go.Bar(x=rows["kernel"], y=rows["GB/s"], text=rows["GB/s"].round(1), name="kernel"))
    fig.add_hline(y=bandwidth_bytes_per_s / 1e9, line_dash="dash", annotation_text="memory bandwidth (copy)")
    fig.update_layout(xaxis_title="one-row kernel", yaxis_title="weight streamed (GB/s)")
    return fig


def format_explorer(quality: pd.DataFrame, budget_bytes: int = 256 * 2**20):
    """A widget over the measured table: pick a weight format and a KV cache format, see memory, KV
    capacity in ``budget_bytes`` and quality. Nothing is re-measured: every number is a row of ``quality``."""
    import ipywidgets as widgets
    from IPython.display import display

    weight_rows = [r for r in quality.index if "kv-" not in r]
    kv_rows = {"float32": "float32"} | {r.removeprefix("kv-"): r for r in quality.index if r.startswith("kv-")}
    weights = widgets.Dropdown(options=weight_rows, description="weights")
    kv = widgets.Dropdown(options=list(kv_rows), description="KV cache")
    out = widgets.Output()

    def show(_=None) -> None:
        w, k = quality.loc[weights.value], quality.loc[kv_rows[kv.value]]
        tokens = budget_bytes // int(k["KV bytes/token"])
        with out:
            out.clear_output()
            print(f"weights {w['weights (MB)']:.0f} MB ({w['bits/weight']:.2f} bits a weight), "
                  f"{w['read per step (MB)']:.0f} MB read per decode step")  # fmt: skip
            mib = budget_bytes / 2**20
            print(f"KV cache {int(k['KV bytes/token']):,} bytes a token: {tokens:,} tokens in {mib:.0f} MiB")
            print(f"quality, measured separately against float32: weights KL {w['KL (nats/token)']:.4f}, "
                  f"cache KL {k['KL (nats/token)']:.4f} nats/token; perplexity {w['perplexity']:.2f}")  # fmt: skip

    weights.observe(show, "value")
    kv.observe(show, "value")
    show()
    display(widgets.VBox([widgets.HBox([weights, kv]), out]))

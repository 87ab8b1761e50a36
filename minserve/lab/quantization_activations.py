"""Chapter 07's activation lesson: the outlier channels that make int8 activations hard, W8A8 measured on
quality, and SmoothQuant's migration. The quantizing lives in :mod:`minserve.quant.activations`; this
module shapes it into the notebook's edits, tables and figures.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import plotly.graph_objects as go
import torch

from minserve.engine.llm import LLM
from minserve.engine.model_setup import calibration_ids
from minserve.quant.activations import (
    SMOOTH_ALPHA,
    input_channel_max,
    projection_names,
    quantize_w8a8,
    smoothing_scales,
)


def _ids(llm: LLM) -> torch.Tensor:
    """The calibration text's tokens (not the held-out text the quality is scored on)."""
    return calibration_ids(llm.tokenizer, next(llm.model.parameters()).device)


def w8a8_edits(alpha: float = SMOOTH_ALPHA) -> dict[str, Callable[[LLM], None]]:
    """``compare_formats``' edits: plain W8A8, and W8A8 after SmoothQuant's migration with ``alpha``."""
    return {
        "w8a8": lambda llm: quantize_w8a8(llm.model),
        f"w8a8-smooth-{alpha:g}": lambda llm: quantize_w8a8(llm.model, _ids(llm), alpha),
    }


def outlier_table(llm: LLM) -> pd.DataFrame:
    """Per decoder projection: the largest input magnitude on the calibration text, the median channel's
    largest, and their ratio (how many of a per-token int8 grid's 127 steps the typical channel keeps is
    about 127 / ratio)."""
    names = projection_names(llm.model)
    maxima = input_channel_max(llm.model, _ids(llm), names)
    rows = []
    for name in names:
        m = maxima[name]
        rows.append({
            "layer": name, "largest |x|": float(m.max()), "median channel's max |x|": float(m.median()),
            "ratio": float(m.max() / m.median()), "channel": int(m.argmax()),
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("layer")


def outlier_figure(llm: LLM, layer: str, alpha: float = SMOOTH_ALPHA) -> go.Figure:
    """Per input channel of ``layer``: the largest |x| on the calibration text, and the same after
    SmoothQuant's division by ``s`` (log scale: the outliers sit decades above the rest)."""
    maxima = input_channel_max(llm.model, _ids(llm), [layer])[layer]
    weight = llm.model.get_submodule(layer).weight
    smoothed = maxima / smoothing_scales(maxima, weight, alpha)
    channels = torch.arange(len(maxima)).numpy()
    fig = go.Figure()
    fig.add_scatter(x=channels, y=maxima.numpy(), mode="lines", name="max |x| per channel")
    fig.add_scatter(x=channels, y=smoothed.numpy(), mode="lines", name=f"max |x / s|, SmoothQuant α = {alpha:g}")
    fig.update_layout(
        title=f"inputs of {layer}", xaxis_title="input channel", yaxis_title="largest |x| (log)", yaxis_type="log"
    )
    return fig


def w8a8_table(by_model: dict[str, pd.DataFrame], rows: tuple[str, ...]) -> pd.DataFrame:
    """The ``rows`` of each model's quality table side by side (KL, top-1 agreement, perplexity)."""
    columns = ["KL (nats/token)", "top-1 agreement", "perplexity"]
    return pd.concat({model: table.loc[list(rows), columns] for model, table in by_model.items()})

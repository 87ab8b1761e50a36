"""The KV calculator widget and the KV-memory-versus-context figure (chapter 04).

The numbers come from :mod:`minserve.capacity`; :func:`kv_calculator_result` is the widget's whole callback
as a plain function (tests call it directly), and :func:`kv_calculator` only wires controls to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from minserve import capacity
from minserve.capacity.kv import ModelLike
from minserve.lab.theme import SLO_COLOR, register_course_theme

DEFAULT_GPUS = ("L4 24GB", "H100 80GB", "H200 141GB")
DTYPES = ("bfloat16", "float16", "fp8", "float32")


def format_bytes(n: float) -> str:
    """Decimal units, as accelerator memory is sold: ``format_bytes(131072)`` → ``"131.1 kB"``."""
    sign, n = ("−" if n < 0 else ""), abs(n)
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1000
    return f"{sign}{n:.1f} TB"


def resolve_model(choice: str, pasted_config: str = "", models: Mapping[str, ModelLike] | None = None) -> ModelLike:
    """What the calculator sizes: a pasted ``config.json`` if there is one, else the chosen name.

    The name is looked up in ``models`` first, then among the presets. Raises ``ValueError`` for text that
    is not a JSON object.
    """
    if pasted_config.strip():
        try:
            hf = json.loads(pasted_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"the pasted config is not JSON: {error}") from None
        if not isinstance(hf, dict):
            raise ValueError("the pasted config must be a JSON object, like a config.json")
        return hf
    return (models or {}).get(choice, choice)


def kv_calculator_result(
    model: ModelLike,
    context_tokens: int,
    batch: int,
    dtype: str = "bfloat16",
    gpu: str = "H100 80GB",
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """Everything the calculator shows, in bytes: per token, per request, batch total, weights, headroom.

    Keys: the fields of :class:`minserve.capacity.Fit` (``kv_bytes`` is the batch total); invariants:
    ``kv_bytes == batch × kv_bytes_per_request`` and ``fits`` ⇔ ``headroom_bytes ≥ 0``.
    """
    result = capacity.fit(model, gpu, context_tokens, batch, dtype=dtype, kv_dtype=kv_dtype)
    return vars(result).copy()


def kv_summary_html(result: Mapping[str, Any]) -> str:
    """The calculator's readout as a small HTML table, with a verdict line."""
    rows = [
        ("KV per token", f"{result['kv_bytes_per_token']:,} B"),
        ("KV per request", format_bytes(result["kv_bytes_per_request"])),
        ("KV for the batch", format_bytes(result["kv_bytes"])),
        ("weights", format_bytes(result["weights_bytes"])),
        ("usable memory", format_bytes(result["usable_bytes"])),
        ("headroom", format_bytes(result["headroom_bytes"])),
        ("max batch at this context", f"{result['max_sequences']:,}"),
    ]
    body = "".join(
        f"<tr><td style='padding:0 12px'>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in rows
    )
    verdict = "fits" if result["fits"] else "does not fit"
    colour = "#009E73" if result["fits"] else SLO_COLOR
    return f"<table>{body}</table><p style='color:{colour};font-weight:bold'>{verdict}</p>"


def kv_calculator(
    models: Mapping[str, ModelLike] | None = None,
    model: str = "Llama-3-8B",
    context_tokens: int = 8192,
    batch: int = 16,
    gpu: str = "H100 80GB",
) -> widgets.VBox:
    """Model, context, batch, dtype and GPU controls above the readout; paste a config.json to size any model."""
    extra = dict(models or {})
    choice = widgets.Dropdown(options=[*extra, *capacity.MODEL_PRESETS], value=model, description="model")
    pasted = widgets.Textarea(placeholder="…or paste a config.json here", layout=widgets.Layout(width="480px"))
    context = widgets.IntText(value=context_tokens, description="context")
    batch_box = widgets.IntText(value=batch, description="batch")
    dtype = widgets.Dropdown(options=DTYPES, value="bfloat16", description="weights")
    kv_dtype = widgets.Dropdown(options=DTYPES, value="bfloat16", description="KV cache")
    gpu_box = widgets.Dropdown(options=list(capacity.GPU_MEMORY_BYTES), value=gpu, description="GPU")
    readout = widgets.HTML()
    controls = [choice, pasted, context, batch_box, dtype, kv_dtype, gpu_box]

    def update(_change: object = None) -> None:
        try:
            target = resolve_model(choice.value, pasted.value, extra)
            result = kv_calculator_result(
                target, max(context.value, 1), max(batch_box.value, 1), dtype.value, gpu_box.value, kv_dtype.value
            )
            readout.value = kv_summary_html(result)
        except (ValueError, KeyError) as error:  # a bad paste or an unsupported config: say why, keep going
            readout.value = f"<p style='color:{SLO_COLOR}'>{error}</p>"

    for control in controls:
        control.observe(update, names="value")
    update()
    return widgets.VBox([*controls, readout])


def kv_memory_curve_gb(
    model: ModelLike, contexts_tokens: Sequence[int], concurrency: int = 1, dtype: str = "bfloat16"
) -> list[float]:
    """KV memory in GB (10⁹ bytes) of ``concurrency`` sequences at each context length: a straight line."""
    config = capacity.model_config(model)
    return [capacity.kv_bytes_total(config, n, concurrency, dtype) / 1e9 for n in contexts_tokens]


def kv_memory_figure(
    models: Sequence[str] | Mapping[str, ModelLike] = ("Llama-2-7B", "Llama-3-8B", "Llama-3-70B"),
    contexts_tokens: Sequence[int] = tuple(range(0, 131_073, 4096)),
    concurrency: int = 1,
    dtype: str = "bfloat16",
    gpus: Sequence[str] = DEFAULT_GPUS,
) -> go.Figure:
    """KV memory versus context length, one line per model, with each GPU's whole memory as a dashed line.

    Read it as: where a model's line crosses a GPU's line, the KV cache alone fills that GPU (before weights).
    """
    named = models if isinstance(models, Mapping) else {name: name for name in models}
    fig = go.Figure()
    for name, model in named.items():
        ys = kv_memory_curve_gb(model, contexts_tokens, concurrency, dtype)
        fig.add_trace(go.Scatter(x=list(contexts_tokens), y=ys, mode="lines", name=name))
    for gpu in gpus:
        fig.add_hline(
            y=capacity.gpu_memory_bytes(gpu) / 1e9,
            line_dash="dash",
            line_color="gray",
            annotation_text=gpu,
            annotation_position="top left",
        )
    fig.update_layout(
        template=register_course_theme(),
        title=f"KV cache for {concurrency} sequence{'s' * (concurrency != 1)} in {dtype}",
        xaxis_title="context length (tokens)",
        yaxis_title="KV cache (GB)",
    )
    return fig

"""Chapter 03's roofline explorer: one model on one accelerator at a batch and a context, predicted.

:func:`roofline_explorer_result` is the widget's whole callback as a plain function (tests call it
directly); :func:`explorer_summary_html` renders it, and :func:`roofline_explorer` only wires controls to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ipywidgets as widgets

from minserve import capacity
from minserve.capacity.kv import DTYPE_BYTES, Dtype, ModelLike
from minserve.capacity.memory import estimate_params, expert_params
from minserve.capacity.roofline import Hardware, decoder_matmul_params, decoder_read_params, lm_head_params
from minserve.lab.roofline_tables import GPUS, resolve_hardware
from minserve.lab.theme import SLO_COLOR


def roofline_explorer_result(
    model: ModelLike,
    hw: str | Hardware,
    batch: int,
    context_tokens: int,
    prompt_tokens: int | None = None,
    dtype: Dtype | None = None,
    hardware: Mapping[str, Hardware] | None = None,
) -> dict[str, Any]:
    """Everything the explorer shows for one model on one accelerator at one batch and context.

    Keys: ``hardware`` (its name), ``dtype``, ``decode_step_s``, ``decode_compute_s``, ``decode_memory_s``,
    ``decode_bound``, ``decode_intensity``, ``ridge``, ``critical_batch``, ``tokens_per_s`` (the whole batch),
    ``tokens_per_s_per_sequence``, ``prefill_tokens``, ``prefill_s``, ``prefill_bound``, ``memory_needed_bytes``
    (weights + the batch's KV), ``memory_bytes`` and ``fits``. ``prompt_tokens`` defaults to
    ``context_tokens``; ``hardware`` adds names to the table (this machine, measured). Invariants:
    ``decode_step_s == max(decode_compute_s, decode_memory_s)`` and ``tokens_per_s == batch / decode_step_s``.
    """
    if batch < 1 or context_tokens < 1:
        raise ValueError(f"batch and context must be positive, got {batch} and {context_tokens}")
    config, hw = capacity.model_config(model), resolve_hardware(hw, hardware)
    dtype = dtype or hw.dtype
    prompt_tokens = context_tokens if prompt_tokens is None else prompt_tokens
    decode = capacity.predict_decode(config, batch, context_tokens, hw, dtype)
    prefill = capacity.predict_prefill(config, prompt_tokens, hw, dtype)
    needed = capacity.weights_and_kv_bytes(config, batch, context_tokens, dtype)
    return {
        "hardware": hw.name,
        "dtype": str(dtype),
        "decode_step_s": decode.time_s,
        "decode_compute_s": decode.compute_s,
        "decode_memory_s": decode.memory_s,
        "decode_bound": decode.bound,
        "decode_intensity": decode.intensity_flops_per_byte,
        "ridge": hw.ridge_point_flops_per_byte,
        "critical_batch": capacity.critical_batch_size(hw, dtype),
        "tokens_per_s": batch / decode.time_s,
        "tokens_per_s_per_sequence": 1 / decode.time_s,
        "prefill_tokens": prompt_tokens,
        "prefill_s": prefill.time_s,
        "prefill_bound": prefill.bound,
        "memory_needed_bytes": needed,
        "memory_bytes": hw.memory_bytes,
        "fits": needed <= hw.memory_bytes,
    }


def format_seconds(s: float) -> str:
    """A duration in the unit that reads best: ``format_seconds(0.0042)`` → ``"4.20 ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}" if unit == "s" else f"{s / scale:.2f} {unit}"
    return f"{s * 1e9:.1f} ns"


def explorer_summary_html(result: Mapping[str, Any]) -> str:
    """The explorer's readout: a small HTML table and a verdict on which roof binds."""
    rows = [
        ("decode step", format_seconds(result["decode_step_s"])),
        ("  of which compute / memory", f"{format_seconds(result['decode_compute_s'])} / "
                                        f"{format_seconds(result['decode_memory_s'])}"),
        ("decode intensity / ridge", f"{result['decode_intensity']:.3g} / {result['ridge']:.3g} FLOP/byte"),
        ("tokens/s, whole batch", f"{result['tokens_per_s']:,.0f}"),
        ("tokens/s, each sequence", f"{result['tokens_per_s_per_sequence']:,.1f}"),
        ("critical batch", f"{result['critical_batch']:.0f}"),
        (f"prefill of {result['prefill_tokens']} tokens", f"{format_seconds(result['prefill_s'])} "
                                                          f"({result['prefill_bound']}-bound)"),
        ("weights + KV / memory", f"{result['memory_needed_bytes'] / 1e9:.1f} / {result['memory_bytes'] / 1e9:.0f} GB"),
    ]  # fmt: skip
    body = "".join(
        f"<tr><td style='padding:0 12px'>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in rows
    )
    verdict = f"decode is {result['decode_bound']}-bound on {result['hardware']} in {result['dtype']}"
    colour = "#009E73" if result["decode_bound"] == "compute" else "#0072B2"
    lines = [f"<p style='color:{colour};font-weight:bold'>{verdict}</p>"]
    if not result["fits"]:
        lines.append(f"<p style='color:{SLO_COLOR}'>the weights and this batch's KV cache do not fit in memory</p>")
    return f"<table>{body}</table>" + "".join(lines)


def roofline_explorer(
    models: Mapping[str, ModelLike] | None = None,
    hardware: Mapping[str, Hardware] | None = None,
    model: str = "Llama-3-8B",
    gpu: str = "H100",
    batch: int = 1,
    context_tokens: int = 2048,
) -> widgets.VBox:
    """GPU, model, batch and context controls above the predicted decode step, its roof and tokens/s.

    ``models`` and ``hardware`` add choices to the presets and the hardware table (the embedded model, this
    machine as measured).
    """
    extra_models, extra_hw = dict(models or {}), dict(hardware or {})
    choice = widgets.Dropdown(options=[*extra_models, *capacity.MODEL_PRESETS], value=model, description="model")
    gpu_box = widgets.Dropdown(options=[*GPUS, *extra_hw], value=gpu, description="hardware")
    batch_box = widgets.BoundedIntText(value=batch, min=1, max=1_000_000, description="batch")
    context = widgets.BoundedIntText(value=context_tokens, min=1, max=10_000_000, description="context")
    readout = widgets.HTML()
    controls = [choice, gpu_box, batch_box, context]

    def update(_change: object = None) -> None:
        try:
            target = extra_models.get(choice.value, choice.value)
            result = roofline_explorer_result(target, gpu_box.value, batch_box.value, context.value, hardware=extra_hw)
            readout.value = explorer_summary_html(result)
        except (ValueError, KeyError) as error:
            readout.value = f"<p style='color:{SLO_COLOR}'>{error}</p>"

    for control in controls:
        control.observe(update, names="value")
    update()
    box = widgets.VBox([*controls, readout])
    box.page_data = roofline_page_data(extra_models, extra_hw)  # for the built site, which has no kernel
    return box


def roofline_page_data(
    models: Mapping[str, ModelLike] | None = None, hardware: Mapping[str, Hardware] | None = None
) -> dict[str, Any]:
    """The terms a page needs to evaluate :func:`roofline_explorer_result` itself, for every model and
    accelerator the explorer offers (docs/javascripts/explorers.js does the arithmetic; the site test holds
    its readout to :func:`explorer_summary_html`'s).

    Per model: FLOPs a token's matmuls do (``flops_per_token``), attention FLOPs per query-key pair over all
    layers (``attention_flops_per_pair``), the sliding window, the weights a pass reads with no expert
    (``read_params_fixed``) and what each expert adds in each sparse layer, the parameters in memory, and the
    KV elements a token keeps. Per accelerator: its roofs, memory and dtype.
    """
    named = {**dict(models or {}), **{name: name for name in capacity.MODEL_PRESETS}}
    return {
        "models": {name: _model_terms(capacity.model_config(model)) for name, model in named.items()},
        "hardware": {
            name: {
                "name": hw.name,
                "peak": hw.peak_flops_per_s,
                "bandwidth": hw.memory_bandwidth_bytes_per_s,
                "memory": hw.memory_bytes,
                "dtype": hw.dtype,
            }
            for name in [*GPUS, *(hardware or {})]
            for hw in [resolve_hardware(name, hardware)]
        },
        "dtype_bytes": dict(DTYPE_BYTES),
    }


def _model_terms(config: capacity.ModelConfig) -> dict[str, Any]:
    return {
        "flops_per_token": capacity.flops_per_token(config),
        "attention_flops_per_pair": 4 * config.num_heads * config.head_dim * config.num_layers,
        "window": config.sliding_window,
        "matmul_params": decoder_matmul_params(config),
        "head_params": lm_head_params(config),
        "read_params_fixed": decoder_read_params(config, tokens=0),
        "sparse_layers": len(config.moe_layers),
        "experts": config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "expert_params": expert_params(config) if config.moe_layers else 0,
        "params": estimate_params(config),
        "kv_elements_per_token": capacity.kv_bytes_per_token(config, 1),
    }

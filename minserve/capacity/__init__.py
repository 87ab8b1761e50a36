"""Capacity arithmetic (chapters 03, 04, 09): what fits in accelerator memory and how fast it can go.

Pure functions over model configs and public hardware numbers; no pandas, no plotly (those live in
:mod:`minserve.lab`, which draws these numbers). This package sits above the engine and the model.
:mod:`minserve.capacity.profiler` measures the engine itself, and :mod:`minserve.capacity.simulator` runs the
engine's scheduler on a virtual clock (chapter 05); both use the engine, so each is imported on its own
(``from minserve.capacity import profiler, simulator``); the rest is arithmetic.
"""

from minserve.capacity.kv import (
    DTYPE_BYTES,
    blocks_per_sequence,
    contiguous_kv_bytes,
    dtype_bytes,
    kv_bytes_per_request,
    kv_bytes_per_token,
    kv_bytes_per_token_hf,
    kv_bytes_per_token_preset,
    kv_bytes_total,
    max_concurrent_sequences,
    model_config,
    paged_kv_bytes,
    wasted_slots,
)
from minserve.capacity.memory import Fit, estimate_params, fit, weights_and_kv_bytes, weights_bytes
from minserve.capacity.presets import GPU_MEMORY_BYTES, MODEL_PRESETS, gpu_memory_bytes, model_preset
from minserve.capacity.roofline import (
    HARDWARE,
    Hardware,
    Prediction,
    arithmetic_intensity,
    attainable_flops_per_s,
    attention_intensity_flops_per_byte,
    critical_batch_size,
    decode_bytes,
    decode_flops,
    decode_step_time_s,
    flops_per_token,
    hardware,
    measure_this_machine,
    predict_decode,
    predict_prefill,
    prefill_bytes,
    prefill_flops,
    prefill_time_s,
    ridge_point_flops_per_byte,
    weights_read_bytes,
)

__all__ = [
    "DTYPE_BYTES",
    "GPU_MEMORY_BYTES",
    "HARDWARE",
    "MODEL_PRESETS",
    "Fit",
    "Hardware",
    "Prediction",
    "arithmetic_intensity",
    "attainable_flops_per_s",
    "attention_intensity_flops_per_byte",
    "blocks_per_sequence",
    "contiguous_kv_bytes",
    "critical_batch_size",
    "decode_bytes",
    "decode_flops",
    "decode_step_time_s",
    "dtype_bytes",
    "estimate_params",
    "fit",
    "flops_per_token",
    "gpu_memory_bytes",
    "hardware",
    "kv_bytes_per_request",
    "kv_bytes_per_token",
    "kv_bytes_per_token_hf",
    "kv_bytes_per_token_preset",
    "kv_bytes_total",
    "max_concurrent_sequences",
    "measure_this_machine",
    "model_config",
    "model_preset",
    "paged_kv_bytes",
    "predict_decode",
    "predict_prefill",
    "prefill_bytes",
    "prefill_flops",
    "prefill_time_s",
    "ridge_point_flops_per_byte",
    "wasted_slots",
    "weights_and_kv_bytes",
    "weights_bytes",
    "weights_read_bytes",
]

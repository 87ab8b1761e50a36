"""Capacity arithmetic (chapters 03, 04, 09): what fits in accelerator memory and how fast it can go.

Pure functions over model configs and public hardware numbers; no pandas, no plotly (those live in
:mod:`minserve.lab`, which draws these numbers). This package sits above the engine and the model.
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
from minserve.capacity.memory import Fit, estimate_params, fit, weights_bytes
from minserve.capacity.presets import GPU_MEMORY_BYTES, MODEL_PRESETS, gpu_memory_bytes, model_preset

__all__ = [
    "DTYPE_BYTES",
    "GPU_MEMORY_BYTES",
    "MODEL_PRESETS",
    "Fit",
    "blocks_per_sequence",
    "contiguous_kv_bytes",
    "dtype_bytes",
    "estimate_params",
    "fit",
    "gpu_memory_bytes",
    "kv_bytes_per_request",
    "kv_bytes_per_token",
    "kv_bytes_per_token_hf",
    "kv_bytes_per_token_preset",
    "kv_bytes_total",
    "max_concurrent_sequences",
    "model_config",
    "model_preset",
    "paged_kv_bytes",
    "wasted_slots",
    "weights_bytes",
]

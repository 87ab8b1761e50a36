"""Chapter 08 on production GPUs: where prompt lookup stops paying, from the roofline, for public models on
datasheet hardware (:mod:`minserve.capacity.roofline`'s presets)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from minserve.capacity.kv import kv_bytes_per_token, model_config
from minserve.capacity.memory import weights_bytes
from minserve.capacity.presets import MODEL_PRESETS
from minserve.capacity.roofline import critical_batch_size, hardware
from minserve.capacity.speculation import roofline_stop_paying_batch, stop_paying_batch


def production_table(
    models: Sequence[str] = ("Llama-3-8B",),
    gpus: Sequence[str] = ("H100", "H200"),
    acceptances: Sequence[float] = (0.6, 0.8),
    k: int = 3,
    context_tokens: int = 1024,
) -> pd.DataFrame:
    """Where prompt lookup (c = 0) stops paying on datasheet GPUs in bf16: the critical batch B*, the
    stop-paying batch from the weights alone (B*·E/(k+1)), and with every sequence reading a ``context_tokens``
    KV cache (its k + 1 queries share one read), beside the largest batch whose KV fits in the GPU's memory."""
    rows = []
    for name in models:
        config = model_config(MODEL_PRESETS[name])
        for gpu in gpus:
            hw = hardware(gpu)
            fits = (hw.memory_bytes - weights_bytes(config, hw.dtype)) // (context_tokens * kv_bytes_per_token(config))
            for alpha in acceptances:
                with_kv = roofline_stop_paying_batch(config, hw, alpha, k, context_tokens, max_batch=int(fits))
                rows.append({
                    "model": name, "GPU": hw.name, "α": alpha, "k": k, "B*": critical_batch_size(hw),
                    "stops paying, weights only": stop_paying_batch(critical_batch_size(hw), alpha, k),
                    f"stops paying, {context_tokens}-token KV": "never, up to the batch that fits"
                    if with_kv >= fits else with_kv,
                    f"batch that fits at {context_tokens} tokens": int(fits),
                })  # fmt: skip
    return pd.DataFrame(rows).round(1)

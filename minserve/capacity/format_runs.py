"""The engine in each storage format, measured: single-stream decode speed against the bytes a step reads.

Chapter 03's roofline says one stream's decode is memory-bound on a CPU: each step reads every weight once,
so tokens/s should rise as the bytes per weight fall. :func:`format_speed_table` measures that per format
(a :func:`minserve.quant.swap.format_options` label, or ``fp32`` / ``bf16``) beside the roofline's
bound, this machine's copy bandwidth over the bytes of weights a step reads.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import pandas as pd

from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.quant.swap import format_options, linear_weight_bytes

PROMPT = [1, 2, 3, 4]  # a short prompt: the decode steps are what is timed


def storage_options(label: str) -> dict:
    """``fp32`` and ``bf16`` are dtypes; anything else is a format on float32 (see ``format_options``)."""
    if label in ("fp32", "bf16"):
        return {"dtype": "float32" if label == "fp32" else "bfloat16"}
    return {"dtype": "float32"} | format_options(label)


def single_stream_rate(llm: LLM, tokens: int = 32, repeats: int = 2) -> float:
    """Decode tokens/s of one request alone: tokens after the first over the time they took (median)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=2))  # warm-up
    rates = []
    for _ in range(repeats):
        times = llm.generate([PROMPT], params)[0].metrics.token_times_s
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return statistics.median(rates)


def format_speed_table(
    model: str, labels: Sequence[str], bandwidth_bytes_per_s: float, tokens: int = 32, repeats: int = 2
) -> pd.DataFrame:
    """Per format: bits per weight, MB of weights a decode step reads, measured single-stream tokens/s, and
    the roofline's tokens/s (bandwidth / bytes read), one model loaded at a time."""
    rows = []
    for label in labels:
        llm = LLM(model, enable_tracing=False, kv_cache_memory_bytes=32 * 2**20, **storage_options(label))
        step_bytes, weights = linear_weight_bytes(llm.model)
        rate = single_stream_rate(llm, tokens, repeats)
        rows.append({
            "format": label,
            "bits/weight": 8 * step_bytes / weights,
            "read per step (MB)": step_bytes / 1e6,
            "tokens/s": rate,
            "roofline tokens/s": bandwidth_bytes_per_s / step_bytes,
        })  # fmt: skip
        del llm
    table = pd.DataFrame(rows).set_index("format")
    return table.assign(**{"of the roofline": table["tokens/s"] / table["roofline tokens/s"]})

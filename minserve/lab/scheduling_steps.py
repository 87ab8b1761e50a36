"""Chapter 05's first measurement: what one decode step costs with one sequence in it and with a batch.

Batching pays when a step has a cost that the sequences in it share. Which cost that is depends on the model
and the machine: on ``minserve-tiny`` (14 MB of weights) it is the step's fixed overhead, the Python, the
scheduling and the launch of many small kernels; on a model whose weights take hundreds of megabytes or more
(SmolLM2-135M on a CPU, any production model on a GPU) it is reading the weights once. Either way the batch
pays it once. The timing is :func:`minserve.capacity.profiler.profile_decode`'s (median of pure decode steps,
garbage collection paused); this module only picks the points and lays them out. :func:`busy_step_s` is
the calibrated cost model's time of a full step, to turn a count of steps into seconds.

Units: seconds in the points, milliseconds in the table.
"""

from __future__ import annotations

import pandas as pd

from minserve.capacity.cost_model import StepCostModel, StepFeatures
from minserve.capacity.profiler import DecodePoint, profile_decode
from minserve.capacity.roofline import measure_this_machine
from minserve.capacity.simulator import SchedulerConfig
from minserve.engine.llm import LLM


def shared_step_points(llm: LLM, batch: int = 8, context_tokens: int = 32, steps: int = 8) -> list[DecodePoint]:
    """Decode steps of 1 and of ``batch`` sequences of ``context_tokens``-token prompts, ``steps`` timed each.
    The engine needs ``max_num_seqs ≥ batch`` and a ``max_model_len`` small enough for its KV blocks (the
    profiler asks each request for the rest of the context window)."""
    # The points carry a roofline prediction this chapter does not read: a quick, small probe fills it in
    # (the full probe copies 512 MiB, seconds on a busy machine).
    probe = measure_this_machine(copy_mib=16, matmul_size=256, repeats=1, device=llm.engine.device.type)
    return profile_decode(llm, batch_sizes=(1, batch), context_lengths=(context_tokens,), steps=steps, hardware=probe)


def shared_step_table(points: list[DecodePoint]) -> pd.DataFrame:
    """One row per batch size: the step's median ms, and ms per token (the step shared by the batch)."""
    rows = [{"batch": p.batch, "step ms": p.step_s * 1e3, "ms per token": p.step_s * 1e3 / p.batch} for p in points]
    return pd.DataFrame(rows).set_index("batch")


def busy_step_s(
    cost: StepCostModel, config: SchedulerConfig, prompt_tokens: int = 40, context_tokens: int = 64
) -> float:
    """The cost model's time (seconds) of a step under sustained load of short requests: every seat but one
    decoding at a ``context_tokens`` context, the last prefilling a whole ``prompt_tokens``-token prompt (a
    full batch admits a prompt only when a seat frees). A yardstick for turning a wait counted in steps into
    seconds, e.g. how long a stream must last to outlast a bound."""
    decodes = config.max_num_seqs - 1
    features = StepFeatures(
        prefill_tokens=prompt_tokens,
        prefill_seqs=1,
        prefill_attention_pairs=prompt_tokens * (prompt_tokens + 1) // 2,
        decode_seqs=decodes,
        decode_context_tokens=decodes * context_tokens,
        decode_padded_kv_tokens=decodes * context_tokens,
    )
    return cost.step_time_s(features)

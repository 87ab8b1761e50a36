"""Chapter 03's checks: claims about the engine's measured prefill and decode, each raising ``AssertionError``
when the measurement says otherwise.

A check here compares measured numbers with measured numbers (or with the measured roofs), with a margin
stated in its docstring, so that one step slowed down by another process cannot overturn it while an engine
without the property would: one that decodes a sequence per step (its step time grows with the batch),
whose prefill costs per token what decode does, whose decode is no longer bound by its weights (it re-reads
or widens them every step, or a per-step overhead dwarfs the read), or whose step ignores the KV cache.
tests/test_ch03_checks.py feeds each one such numbers. Each returns a sentence of what it found.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from minserve.capacity import decode_fit
from minserve.capacity.profiler import Profile
from minserve.lab.checks import require
from minserve.lab.roofline_weights import KVGrowth, WeightBound


def check_prefill_beats_decode(profile: Profile, factor: float = 10.0) -> str:
    """Prefill and decode are different workloads: the best prefill rate (prompt tokens/s) is more than
    ``factor`` × the decode rate at batch 1 (output tokens/s), at every context measured."""
    best = max(p.tokens_per_s for p in profile.prefill)
    alone = [d for d in profile.decode if d.batch == 1]
    require(bool(alone), "no decode point at batch 1")
    for d in alone:
        message = f"prefill {best:,.0f} tokens/s ≤ {factor} × decode {d.tokens_per_s:,.0f} at context {d.prompt_tokens}"
        require(best > factor * d.tokens_per_s, message)
    slowest = max(d.tokens_per_s for d in alone)
    return f"prefill up to {best:,.0f} tokens/s; decode at batch 1 at most {slowest:,.0f} ({best / slowest:.0f}×)"


def check_decode_sublinear(profile: Profile, batch: int = 8, saving: float = 2.0) -> str:
    """Batching decode pays: at every context, a step of ``batch`` sequences takes less than ``1 / saving``
    of ``batch`` steps of one. An engine that decoded one sequence per step would take all of it.

    Read off the straight line through every batch size's fastest step (:func:`minserve.capacity.decode_fit.
    decode_cost_fit`, a median fit): a burst of load from another process can slow all the timed steps of
    one batch size, but it moves a median line through seven of them hardly at all.
    """
    fastest = Profile(**{**vars(profile), "decode": tuple(replace(d, step_s=min(d.steps_s)) for d in profile.decode)})
    found = []
    for context in sorted({d.prompt_tokens for d in profile.decode}):
        batches = {d.batch for d in profile.decode if d.prompt_tokens == context}
        require(len(batches) >= 3, f"context {context}: need three or more batch sizes, got {sorted(batches)}")
        fit = decode_fit.decode_cost_fit(fastest, context)
        ratio = (fit["fixed_s"] + batch * fit["per_sequence_s"]) / (fit["fixed_s"] + fit["per_sequence_s"])
        require(ratio * saving < batch, f"context {context}: a step of {batch} takes {ratio:.1f}× the step of 1")
        found.append(f"{ratio:.1f}× at context {context}")
    return f"a step of {batch} takes " + ", ".join(found) + f" the step of 1 (for {batch}× the tokens)"


def check_bound_by_weights(run: WeightBound, batch: int = 1, within: float = 2.5, overhead_at_most: float = 2.0) -> str:
    """Decode at ``batch`` is bound by reading the weights: its fastest step is within ``within`` × (weight
    bytes ÷ measured read bandwidth), either way, and at most ``overhead_at_most`` × one measured pass of a
    token through every weight matrix (so the matmuls, not what surrounds them, are the step).

    Fails for an engine that re-reads or widens its weights every step (the step grows past the read), for
    one whose per-step overhead dwarfs the read (the step is many passes long: the embedded model on a CPU),
    and for a roof that is wrong (a step faster than reading the weights once: they sat in a cache).
    ``run``: :func:`minserve.lab.roofline_weights.measure_weight_bound`, probe and steps in alternating rounds.
    """
    step, read, matmuls = run.step_s(batch), run.weight_read_s, run.weights_pass_s
    name = f"{run.model} ({run.dtype})"
    require(step <= within * read, f"{name}: step {step * 1e3:.1f} ms > {within} × weight read {read * 1e3:.1f} ms")
    require(step * within >= read, f"{name}: step {step * 1e3:.1f} ms < weight read {read * 1e3:.1f} ms / {within}")
    require(
        step <= overhead_at_most * matmuls,
        f"{name}: step {step * 1e3:.2f} ms > {overhead_at_most} × the pass through its weights {matmuls * 1e3:.2f} ms",
    )
    return (
        f"{name}, batch {batch}: step {step * 1e3:.1f} ms = {step / read:.2f} × the weight read "
        f"({read * 1e3:.1f} ms at {run.hardware.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s), "
        f"{step / matmuls:.2f} × one pass through the weights"
    )


def check_batch_shares_weights(run: WeightBound, batch: int = 4, at_most: float = 2.5) -> str:
    """A batch shares the weight read: the fastest step of ``batch`` sequences takes at most ``at_most`` ×
    the step of one (an engine that read the weights once per sequence would take ``batch`` ×)."""
    one, many = run.step_s(1), run.step_s(batch)
    require(many <= at_most * one, f"step of {batch}: {many * 1e3:.1f} ms > {at_most} × step of 1 {one * 1e3:.1f} ms")
    return (
        f"{run.model} ({run.dtype}): a step of {batch} takes {many / one:.2f}× the step of 1, for {batch}× the tokens"
    )


def check_kv_growth(kv: KVGrowth, share: float = 0.5) -> str:
    """At a long context a decode step reads every sequence's KV cache too: the same batch's fastest step
    grows from the short context to the long one by at least ``share`` × what the bytes predict
    (``bytes long / bytes short − 1``). An engine whose decode ignored the cache (or whose step is so
    dominated by something else that the cache does not show) fails."""
    measured, predicted = kv.measured_growth, kv.predicted_growth
    require(predicted > 0, f"the long context {kv.contexts[1]} adds no bytes over {kv.contexts[0]}")
    require(
        measured >= share * predicted,
        f"step grew {measured:+.0%} from context {kv.contexts[0]} to {kv.contexts[1]}; the bytes say {predicted:+.0%}",
    )
    return (
        f"batch {kv.batch}, context {kv.contexts[0]} → {kv.contexts[1]}: {kv.kv_bytes[1] / 1e6:.0f} MB of KV, "
        f"bytes {predicted:+.0%}, step {measured:+.0%}"
    )


def check_kernels_match(table: pd.DataFrame) -> str:
    """Every Triton kernel equals its torch reference on its tiny input (:func:`minserve.lab.kernel_bench.
    kernel_correctness`), within the float32 tolerance."""
    diffs = table["max |kernel − reference|"]
    require(bool(table["ok"].all()), f"kernels off their reference: {diffs[~table['ok']].to_dict()}")
    return f"{len(table)} kernels match their references (largest difference {diffs.max():.1e})"


def check_same_tokens(triton_tokens: list[int], torch_tokens: list[int]) -> str:
    """The Triton backend generates, greedily, exactly the tokens the torch backend does."""
    require(list(triton_tokens) == list(torch_tokens), f"triton {triton_tokens} ≠ torch {torch_tokens}")
    return f"the Triton and torch backends generate the same {len(torch_tokens)} greedy tokens"

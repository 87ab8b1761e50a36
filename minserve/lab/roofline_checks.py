"""Chapter 03's checks: claims about the engine's measured prefill and decode, each raising ``AssertionError``
when the measurement says otherwise.

A check here compares measured numbers with measured numbers (or with the measured roofs), with a margin
stated in its docstring, so that one step slowed down by another process cannot overturn it while an engine
without the property would: one that decodes a sequence per step (its step time grows with the batch),
whose prefill costs per token what decode does, or whose points sit above the roofline (a wrong bound).
tests/test_ch03_checks.py feeds each one such numbers. Each returns a sentence of what it found.

:func:`paired_decode` is the measurement behind the fixed-cost check: decode steps at batch 1 and at a large
batch, measured in alternating rounds so that load coming and going touches both alike, the fastest kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pandas as pd

from minserve.capacity import decode_fit, profiler
from minserve.capacity.profiler import Profile
from minserve.capacity.roofline import Hardware
from minserve.lab.anatomy_checks import require

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


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


def check_under_the_roof(table: pd.DataFrame, share: float = 0.75) -> str:
    """The roofline is a lower bound on time: at least ``share`` of the measured points took longer than
    their bound (``× bound ≥ 1`` in :func:`minserve.lab.roofline_tables.profile_table`). Not every point:
    a tiny model's weights can sit in the CPU's cache, read faster than the probe's DRAM roof."""
    under = float((table["× bound"] >= 1).mean())
    require(under >= share, f"only {under:.0%} of the points are under the roof, expected ≥ {share:.0%}")
    return f"{under:.0%} of {len(table)} points under the roof; median {table['× bound'].median():.1f}× the bound"


@dataclass(frozen=True)
class PairedDecode:
    """Decode steps at batch 1 and at ``batch``, measured in alternating rounds (seconds).

    ``alone_s`` and ``batched_s``: the fastest step of each over every round. ``rounds``: each round's
    median steps, to show the spread. ``fixed_s`` and ``per_sequence_s``: the line through the two fastest,
    ``step = fixed + per_sequence × b``.
    """

    batch: int
    context: int
    alone_s: float
    batched_s: float
    rounds: tuple[tuple[float, float], ...]

    @property
    def per_sequence_s(self) -> float:
        return (self.batched_s - self.alone_s) / (self.batch - 1)

    @property
    def fixed_s(self) -> float:
        return self.alone_s - self.per_sequence_s


def paired_decode(
    llm: LLM, hardware: Hardware, batch: int = 16, context: int = 64, rounds: int = 5, steps: int = 8
) -> PairedDecode:
    """Measure batch 1, then ``batch``, ``rounds`` times over (pure decode steps, ``steps`` timed each).

    Alternating rounds spread both sizes over the same seconds, so load that comes and goes touches both;
    the fastest step of each counts, because load only ever adds time (as the roofline's probe takes its
    best run). About 2 s on the embedded model on a quiet 2-core CPU.
    """
    measured = [profiler.profile_decode(llm, (1, batch), (context,), steps, hardware) for _ in range(rounds)]
    alone = min(t for one, _ in measured for t in one.steps_s)
    batched = min(t for _, many in measured for t in many.steps_s)
    return PairedDecode(batch, context, alone, batched, tuple((one.step_s, many.step_s) for one, many in measured))


def check_fixed_cost_dominates(paired: PairedDecode, margin: float = 2.0) -> str:
    """A decode step's fixed cost (what it pays before any sequence) is more than ``margin`` × what each
    sequence adds: measured as the fastest steps of alternating rounds (:func:`paired_decode`), so that a
    loaded machine does not overturn it (on a quiet one the ratio is about 10). An engine that ran one
    sequence per step would have no fixed cost to share (``fixed ≈ 0``)."""
    fixed, per_seq = paired.fixed_s, paired.per_sequence_s
    require(fixed > margin * per_seq, f"fixed {fixed * 1e3:.3f} ms ≤ {margin} × per sequence {per_seq * 1e3:.3f} ms")
    return (
        f"batch 1: {paired.alone_s * 1e3:.2f} ms, batch {paired.batch}: {paired.batched_s * 1e3:.2f} ms per step → "
        f"fixed {fixed * 1e3:.2f} ms, {per_seq * 1e3:.3f} ms per sequence ({fixed / per_seq:.0f}×)"
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

"""A straight line through a profile's decode steps: what a step costs before any sequence, and per sequence.

``step ≈ fixed + per_sequence × batch`` (seconds), read off the engine as
:mod:`minserve.capacity.profiler` measured it. Chapter 03 sets the line beside the roofline's bound: the
bound has no fixed cost, the engine does.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minserve.capacity.profiler import Profile


def decode_cost_fit(profile: Profile, prompt_tokens: int | None = None) -> dict[str, float]:
    """A straight line through the measured decode step times against batch size, at one context length.

    ``step ≈ fixed + per_sequence × batch``: ``fixed_s`` is what a step costs before it does any work for a
    sequence (the Python around the model, launching every operator, reading the weights), ``per_sequence_s``
    what each extra sequence adds. ``prompt_tokens`` picks the decode sweep's context (default: the shortest).

    The line is a Theil–Sen fit (the median of the slopes between every pair of points, then the median
    intercept), not least squares: on a shared machine one step slowed down by another process would drag a
    least-squares line anywhere, while a median ignores it. Needs two or more batch sizes at that context.
    """
    contexts = sorted({d.prompt_tokens for d in profile.decode})
    if not contexts:
        raise ValueError("the profile has no decode points")
    context = contexts[0] if prompt_tokens is None else prompt_tokens
    points = sorted((d.batch, d.step_s) for d in profile.decode if d.prompt_tokens == context)
    slopes = [(s2 - s1) / (b2 - b1) for i, (b1, s1) in enumerate(points) for b2, s2 in points[i + 1 :] if b2 != b1]
    if not slopes:
        raise ValueError(f"need decode points at two or more batch sizes for context {context}")
    slope = statistics.median(slopes)
    intercept = statistics.median(s - slope * b for b, s in points)
    return {"context_tokens": float(context), "fixed_s": intercept, "per_sequence_s": slope}

"""Chapter 05 exercise, reference solutions (instructors: ``minserve grade ch05 --solutions``)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from minserve.engine.policies import Policy
from minserve.engine.sequence import Sequence as EngineSequence


def static_batching_steps(output_lengths: Sequence[int], batch_size: int) -> int:
    """Steps to serve the requests in batches of ``batch_size``, each batch running until its longest is done."""
    _check(output_lengths, batch_size)
    return sum(max(output_lengths[i : i + batch_size]) for i in range(0, len(output_lengths), batch_size))


def continuous_batching_steps(output_lengths: Sequence[int], batch_size: int) -> int:
    """Steps when every finished request's seat is given to the next one in line at the very next step."""
    _check(output_lengths, batch_size)
    seats = [0] * min(batch_size, len(output_lengths))  # the step after which each seat is free again
    finish = 0
    for n in output_lengths:
        free_at = heapq.heappop(seats)  # the seat that frees first takes the next request in line
        finish = max(finish, free_at + n)
        heapq.heappush(seats, free_at + n)
    return finish


def _check(output_lengths: Sequence[int], batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    if any(n < 1 for n in output_lengths):
        raise ValueError("every request produces at least one token")


def aging_bound_steps(long_prompt_tokens: int, short_prompt_tokens: int, aging_tokens_per_step: float) -> float:
    """Steps of waiting after which a long prompt ranks ahead of a short one that has just arrived."""
    if long_prompt_tokens < 1 or short_prompt_tokens < 1:
        raise ValueError("prompts have at least one token")
    if aging_tokens_per_step < 0:
        raise ValueError(f"aging_tokens_per_step must be ≥ 0, got {aging_tokens_per_step}")
    gap = long_prompt_tokens - short_prompt_tokens
    if gap <= 0:
        return 0.0
    return math.inf if aging_tokens_per_step == 0 else gap / aging_tokens_per_step


class FairShortestFirst(Policy):
    """Shortest remaining work first, aged: ``(tokens left to compute − aging × steps waited, arrival)``."""

    name = "fair-shortest-first"

    def __init__(self, aging_tokens_per_step: float = 1.0) -> None:
        if not aging_tokens_per_step >= 0:
            raise ValueError(f"aging_tokens_per_step must be ≥ 0, got {aging_tokens_per_step!r}")
        self.aging_tokens_per_step = aging_tokens_per_step

    def key(self, seq: EngineSequence) -> tuple[float, ...]:
        aged = seq.num_uncomputed_tokens - self.aging_tokens_per_step * seq.steps_waited
        return (aged, seq.arrival_index)

"""Reference solutions for chapter 08 (``minserve grade ch08 --solutions``)."""

from __future__ import annotations

import random


def sample(probabilities: list[float], rng: random.Random) -> int:
    return rng.choices(range(len(probabilities)), weights=probabilities)[0]


def acceptance_probability(p_x: float, q_x: float) -> float:
    if q_x <= 0:
        return 0.0
    return min(1.0, p_x / q_x)


def residual(p: list[float], q: list[float]) -> list[float]:
    left = [max(pi - qi, 0.0) for pi, qi in zip(p, q)]
    total = sum(left)
    return [x / total for x in left] if total > 0 else list(p)


def verify(drafts: list[int], q_rows: list[list[float]], p_rows: list[list[float]], rng: random.Random) -> list[int]:
    if len(q_rows) != len(drafts) or len(p_rows) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts)} q rows and {len(drafts) + 1} p rows")
    emitted = []
    for x, q, p in zip(drafts, q_rows, p_rows):
        if rng.random() < acceptance_probability(p[x], q[x]):
            emitted.append(x)
            continue
        return [*emitted, sample(residual(p, q), rng)]
    return [*emitted, sample(p_rows[-1], rng)]

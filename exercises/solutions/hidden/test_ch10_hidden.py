"""Chapter 10's hidden tests (``minserve grade ch10 --hidden``): the public tests' measure, the knee within
20% of the simulated server's capacity at the SLO, on other workloads (long prompts among short ones),
other SLOs (a tighter TTFT, an end-to-end bound), other seeds and a smaller pool of workers, so an estimate
tuned to the public sweeps does not pass these. Instructors only: this file sits under
``exercises/solutions/``, which the learner's copy of the course never holds.
"""

from __future__ import annotations

import functools

import pytest

from minserve import slo
from minserve.capacity.experiments import mixed_workload, overload_workload
from minserve.capacity.sweep_records import slo_capacity_rps, sweep_records, timetable_rate

TOLERANCE = 0.2


def _long_prompts(num_requests: int, rate_rps: float, seed: int):
    return mixed_workload(num_requests, rate_rps, seed, long_fraction=0.15, short_prompt=(32, 128), output=(8, 48))


# name: (workload, seed, the SLO as the exercise takes it, workers past the knee or None)
SWEEPS = {
    "long prompts, open loop": (_long_prompts, 5, {"ttft": 2.0}, None),
    "tight TTFT, 4 workers": (overload_workload, 9, {"ttft": 0.5}, 4),
    "end to end, 8 workers": (overload_workload, 4, {"e2e": 2.5}, 8),
}


@functools.cache
def _sweep(name: str) -> tuple[float, float, tuple[dict, ...]]:
    """(capacity asked of the load tester, capacity its timetable delivered, the sweep's records)."""
    workload, seed, bounds, workers = SWEEPS[name]
    target = slo.SLO(ttft_s=bounds.get("ttft"), e2e_s=bounds.get("e2e"))
    capacity = slo_capacity_rps(target, workload, seed=seed)
    below = sweep_records([f * capacity for f in (0.3, 0.6, 0.85)], workload, seed=seed)
    above = sweep_records([f * capacity for f in (1.05, 1.4, 2.0)], workload, seed=seed, workers=workers)
    return capacity, capacity * timetable_rate(workload, 200, seed), tuple(below + above)


@pytest.mark.points(3)
@pytest.mark.parametrize("name", list(SWEEPS))
def test_capacity_on_other_workloads_slos_and_pools(exercise, name):
    """The knee within 20% of the capacity on another workload, SLO, seed or pool of workers."""
    asked, delivered, records = _sweep(name)
    estimate = exercise.capacity_rps(list(records), SWEEPS[name][2])
    low, high = (1 - TOLERANCE) * min(asked, delivered), (1 + TOLERANCE) * max(asked, delivered)
    assert low <= estimate <= high, f"{name}: estimated {estimate:.1f} requests/s; capacity {asked:.1f} asked"

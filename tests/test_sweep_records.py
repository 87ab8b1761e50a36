"""A load test's records made by the simulator (minserve.capacity.sweep_records): the records have
records.jsonl's shape, a pool of workers falls behind its timetable past the knee and hides it, and the
capacity found by bisection separates the rates that meet the SLO from those that do not."""

from __future__ import annotations

import pytest

from minserve import slo
from minserve.capacity.experiments import overload_workload
from minserve.capacity.sweep_records import pool_send_times, slo_capacity_rps, sweep_records, timetable_rate

TARGET = slo.SLO(ttft_s=1.0)


def _share_good(records: list[dict], start: str) -> float:
    return sum(r["chunk_times_s"][0] - r[start] <= TARGET.ttft_s for r in records) / len(records)


def test_a_pool_sends_when_a_worker_is_free_and_never_early():
    assert pool_send_times([0.0, 0.0, 0.0, 0.5], [1.0, 3.0, 1.0, 1.0], 2) == [0.0, 0.0, 1.0, 2.0]
    assert pool_send_times([0.0, 1.0], [0.5, 0.5], 1) == [0.0, 1.0]


def test_the_capacity_separates_the_rates_that_meet_the_slo():
    capacity = slo_capacity_rps(TARGET, num_requests=120, iterations=8)
    below, above = (sweep_records([f * capacity], num_requests=120) for f in (0.8, 1.5))
    assert _share_good(below, "intended_s") >= 0.9 > _share_good(above, "intended_s")
    assert below[0]["run"] == f"rate={0.8 * capacity:g}" and below[0]["sent_s"] == below[0]["intended_s"]
    assert {"run", "index", "intended_s", "sent_s", "chunk_times_s", "end_s", "status", "output_tokens"} <= set(
        below[0]
    )


def test_a_pool_past_the_knee_falls_behind_and_hides_it():
    capacity = slo_capacity_rps(TARGET, num_requests=120, iterations=8)
    run = sweep_records([2 * capacity], num_requests=120, workers=8)
    assert run[0]["run"].endswith("workers=8")
    assert max(r["sent_s"] - r["intended_s"] for r in run) > 1.0  # the pool fell behind its timetable
    assert _share_good(run, "sent_s") >= 0.9 > _share_good(run, "intended_s")  # fast from the sends only


def test_a_seeded_timetable_delivers_one_share_of_every_rate():
    factor = timetable_rate(overload_workload, 200, seed=0)
    arrivals = [r.arrival_s for r in overload_workload(200, 40.0, 0)]
    assert 0.8 < factor < 1.2
    assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(40.0 * factor)

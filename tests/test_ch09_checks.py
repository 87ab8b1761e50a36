"""Chapter 09's check cells can fail: each check holds on data with its property, and fails on the same
experiment with the property taken away (admission that admits everything or refuses everything, refusals
that wait in the queue, a request lost between client and server, careful retries that retry like naive
ones, an engine slower than the planner predicted).

The admission checks run on the simulator (the server's own policies on a virtual clock, a few seconds);
the served runs' checks on tables of :func:`minserve.bench.overload.overload_table`'s columns, with numbers
of the kind measured on minserve-tiny at 1× to 3× its capacity.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from minserve.admission import DeadlineAware, QueueLength
from minserve.capacity import experiments
from minserve.capacity.confirmation import EngineCheck
from minserve.capacity.planner import RateProbe
from minserve.lab import overload_checks as checks

SLO = experiments.OVERLOAD_SLO  # TTFT ≤ 1 s
ADMITTING, WITHOUT = "deadline-aware", "no admission"


def simulate(policies=None) -> pd.DataFrame:
    return pd.DataFrame(experiments.overload_sweep(policies=policies, num_requests=200))


@pytest.fixture(scope="module")
def simulated() -> pd.DataFrame:
    return simulate()


def relabelled(admitting_policy) -> pd.DataFrame:
    """The sweep with ``admitting_policy`` in the place of deadline-aware admission."""
    return simulate({ADMITTING: admitting_policy, WITHOUT: QueueLength(experiments.NO_ADMISSION)})


# --- admission keeps the SLO, and buys goodput (on the simulator) ---------------------------------------------


def test_admission_keeps_the_slo_and_buys_goodput_in_the_simulator(simulated):
    kept = checks.check_admission_keeps_slo(simulated, SLO.ttft_s, ADMITTING, WITHOUT)
    assert kept[f"{ADMITTING}: admitted p99 TTFT s"] <= SLO.ttft_s < kept[f"{WITHOUT}: p99 TTFT s"]
    goodput = checks.check_goodput(simulated, ADMITTING, WITHOUT)
    assert goodput[f"{ADMITTING} goodput rps"] > goodput[f"{WITHOUT} goodput rps"]


def test_admission_checks_fail_when_admission_admits_everything():
    everyone = relabelled(QueueLength(experiments.NO_ADMISSION))
    with pytest.raises(AssertionError, match="deadline-aware at 3× capacity refused nothing"):
        checks.check_admission_keeps_slo(everyone, SLO.ttft_s, ADMITTING, WITHOUT)
    with pytest.raises(AssertionError, match="need ≥ 1.5×"):
        checks.check_goodput(everyone, ADMITTING, WITHOUT)


def test_admission_checks_fail_when_admission_refuses_everything():
    nobody = relabelled(QueueLength(0))
    with pytest.raises(AssertionError, match="admitted none of 200 requests"):
        checks.check_admission_keeps_slo(nobody, SLO.ttft_s, ADMITTING, WITHOUT)
    with pytest.raises(AssertionError, match="under 50% of the capacity"):
        checks.check_goodput(nobody, ADMITTING, WITHOUT, min_ratio=0)


def test_admission_check_fails_when_the_deadline_is_far_past_the_slo():
    # Aiming at three times the SLO, admission refuses some, but late: the queue it keeps makes most admitted
    # requests miss.
    lax = relabelled(DeadlineAware(3 * SLO.ttft_s))
    with pytest.raises(AssertionError, match="of admitted requests met the SLO, need ≥ 90%"):
        checks.check_admission_keeps_slo(lax, SLO.ttft_s, ADMITTING, WITHOUT)


def test_admission_check_fails_when_the_load_did_not_overload(simulated):
    # Without admission at 1× capacity in the place of 3×: the queue stays short and nearly everyone meets the SLO.
    light = simulated[simulated["load_multiple"] == 1.0].assign(load_multiple=3.0)
    mixed = pd.concat([simulated[simulated["policy"] == ADMITTING], light[light["policy"] == WITHOUT]])
    with pytest.raises(AssertionError, match="no admission at 3× capacity: 100% .* should grow until most miss"):
        checks.check_admission_keeps_slo(mixed, SLO.ttft_s, ADMITTING, WITHOUT)
    with pytest.raises(AssertionError, match="expected one row for 'deadline-aware' at 2×, found 0"):
        checks.at_load(light, ADMITTING, 2.0)


# --- on the server: fast refusals, every request accounted for (tables of the measured kind) ------------------


def served_row(policy: str, load: float, sent: int, succeeded: int, refused: int, timed_out: int, **rest) -> dict:
    met = rest.pop("met_slo", succeeded)
    admitted = sent - refused
    return {
        "policy": policy,
        "load_multiple": load,
        "offered_rps": 10.4 * load,
        "capacity_rps": 11.4,
        "sent": sent,
        "succeeded": succeeded,
        "refused": refused,
        "timed_out": timed_out,
        "failed": rest.pop("failed", 0),
        "met_slo": met,
        "ttft_p50_s": rest.pop("ttft_p50_s", 0.3),
        "ttft_p99_s": rest.pop("ttft_p99_s", 0.8),
        "attainment_admitted": met / admitted if admitted else math.nan,
        "attainment_all": met / sent,
        "goodput_rps": met / 4.0,
        "refusal_p50_s": rest.pop("refusal_p50_s", 0.007 if refused else math.nan),
        "refusal_p99_s": rest.pop("refusal_p99_s", 0.031 if refused else math.nan),
        "server_accounted": rest.pop("server_accounted", True),
    }


@pytest.fixture
def served() -> pd.DataFrame:
    return pd.DataFrame(
        [
            served_row(WITHOUT, 1.0, 46, 46, 0, 0, ttft_p50_s=0.11, ttft_p99_s=0.25),
            served_row(WITHOUT, 3.0, 137, 42, 0, 95, met_slo=20, ttft_p50_s=1.04, ttft_p99_s=4.05),
            served_row(ADMITTING, 1.0, 46, 37, 9, 0, ttft_p50_s=0.17, ttft_p99_s=0.38),
            served_row(ADMITTING, 3.0, 137, 49, 88, 0, ttft_p50_s=0.37, ttft_p99_s=0.81),
        ]
    )


def test_served_checks_hold_on_a_server_with_admission(served):
    checks.check_admission_keeps_slo(served, SLO.ttft_s, ADMITTING, WITHOUT)
    checks.check_goodput(served, ADMITTING, WITHOUT)
    fast = checks.check_fast_refusals(served, ADMITTING, SLO.ttft_s)
    assert fast["refusal p99 ms"] == 31.0 and fast["refused"] == 88
    lost = checks.check_nothing_lost(served, {ADMITTING: 1.02, WITHOUT: 1.1}, max_memory_growth=1.5)
    assert lost == {"requests": 366, "refused": 97, "largest memory growth": 1.1}


def test_fast_refusals_fail_when_refusals_wait_in_the_queue(served):
    slow = served.copy()
    slow.loc[slow["policy"] == ADMITTING, "refusal_p99_s"] = 0.9  # refused only after waiting its turn
    with pytest.raises(AssertionError, match="refusal p99 900 ms, over 0.25 × the 1 s SLO"):
        checks.check_fast_refusals(slow, ADMITTING, SLO.ttft_s)
    with pytest.raises(AssertionError, match="is not faster than an admitted request's median TTFT"):
        checks.check_fast_refusals(slow, ADMITTING, SLO.ttft_s, max_share_of_slo=1.0)
    with pytest.raises(AssertionError, match="no admission at 3× refused nothing"):
        checks.check_fast_refusals(served, WITHOUT, SLO.ttft_s)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("failed", "deadline-aware at 3×: 1 failed"),  # one ended in an error
        ("server disagrees", "deadline-aware at 3×: /metrics counted other outcomes than the client"),
        ("memory grew", "no admission: server memory grew 2.40×, over 1.5×"),  # the excess queued in memory
    ],
)
def test_nothing_lost_fails_when_a_request_fails_is_counted_differently_or_memory_grows(served, broken, message):
    row = served.index[(served["policy"] == ADMITTING) & (served["load_multiple"] == 3.0)][0]
    growth = {ADMITTING: 1.02, WITHOUT: 1.1}
    if broken == "failed":
        served.loc[row, ["succeeded", "failed"]] = [48, 1]
    elif broken == "server disagrees":
        served.loc[row, "server_accounted"] = False
    else:
        growth[WITHOUT] = 2.4
    with pytest.raises(AssertionError, match=message):
        checks.check_nothing_lost(served, growth, max_memory_growth=1.5)


# --- the retry storm ------------------------------------------------------------------------------------------


def storm(**careful) -> pd.DataFrame:
    rows = {
        "naive": (1071, 53, 6.57, 6.0),
        "fixed": (981, 56, 6.02, 6.5),
        "jitter": (622, 163, 3.82, 10.5),
        "jitter+budget": careful.get("jitter_budget", (180, 72, 1.10, 0.5)),
    }
    return pd.DataFrame(
        [(s, *r) for s, r in rows.items()], columns=["strategy", "attempts", "successes", "amplification", "recovery_s"]
    )


def test_retry_storm_check_holds_when_the_budget_stops_the_storm():
    result = checks.check_retry_storm(storm())
    assert result["jitter+budget"]["attempts"] < result["naive"]["attempts"]


@pytest.mark.parametrize(
    ("careful", "message"),
    [
        ((1071, 53, 6.57, 6.0), "jitter\\+budget sent 1071 attempts, naive 1071"),  # retries as naive does
        ((900, 53, 6.9, 6.0), "amplification 6.90 with jitter\\+budget"),  # fewer attempts, but for fewer requests
        ((40, 20, 1.0, 0.0), "jitter\\+budget served 20 requests, naive 53"),  # quiet because it gave up
    ],
)
def test_retry_storm_check_fails_without_the_property(careful, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_retry_storm(storm(jitter_budget=careful))


# --- the envelope, predicted then measured ----------------------------------------------------------------------


def probe(rate_rps: float, attainment: float) -> RateProbe:
    return RateProbe(
        rate_rps,
        {"ttft": attainment, "all": attainment},
        attainment >= 0.95,
        rate_rps * attainment,
        rate_rps * 24,
        150.0,
        20.0,
        0.3,
        0.05,
        1.0,
    )


def envelope_checks(measured: list[float]) -> list[EngineCheck]:
    predicted = [(22.0, 0.5, 1.0), (45.0, 1.0, 0.96), (67.0, 1.5, 0.7)]
    return [
        EngineCheck(rate, share, probe(rate, want), probe(rate, got), 3.0)
        for (rate, share, want), got in zip(predicted, measured)
    ]


def test_envelope_check_holds_when_the_engine_meets_the_prediction():
    result = checks.check_envelope_confirmed(envelope_checks([0.99, 0.9, 0.62]), required_attainment=0.95)
    assert result["22 req/s"] == (1.0, 0.99)
    # Past the knee only the direction counts: the cliff there moves with the machine's speed.
    assert checks.check_envelope_confirmed(envelope_checks([0.99, 0.9, 0.3]), required_attainment=0.95)


@pytest.mark.parametrize(
    ("measured", "tolerance", "message"),
    [
        # Half as fast as calibrated: already at the knee it is overloaded.
        ([0.99, 0.3, 0.1], 0.2, "at 45 req/s the engine met the SLO for 30% of requests, the simulator predicted 96%"),
        # Slower still: it misses at half the knee.
        ([0.7, 0.3, 0.1], 0.2, "at 22 req/s the engine met the SLO for 70% of requests, the simulator predicted 100%"),
        # Slower only at a light load, within the tolerance of the prediction but not of the SLO.
        ([0.8, 0.9, 0.62], 0.2, "below the knee \\(22 req/s\\) the engine met the SLO for only 80%"),
        # Better overloaded than lightly loaded: not a queue.
        ([0.9, 0.95, 0.92], 0.3, "measured attainment rose with the rate: 90% at the lowest, 92% at the highest"),
    ],
)
def test_envelope_check_fails_for_an_engine_the_planner_does_not_describe(measured, tolerance, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_envelope_confirmed(envelope_checks(measured), required_attainment=0.95, tolerance=tolerance)

"""Chapter 09's graded tests can fail: the shortcuts a learner might try lose the points they aim at.

The graded tests are called here in this process on small stand-in exercise modules (no grader child, no
server), so each shortcut costs one simulation: admitting everything and refusing everything both fail the
goodput test; the reference solution aimed at the SLO itself (headroom 1) fails the admitted requests' SLO;
a policy borrowed from minserve is refused, by the import rule and by the class check.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from minserve import exercise_rules
from minserve.admission import AdmissionPolicy, DeadlineAware, QueueLength, Refusal
from minserve.capacity.experiments import NO_ADMISSION, overload_sweep

EXERCISES = Path(__file__).resolve().parents[1] / "exercises"


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRADED = _load(EXERCISES / "tests" / "test_ch09.py", "graded_test_ch09")


def _exercise(policy_class: type) -> types.ModuleType:
    """A stand-in for a learner's module whose SLOAdmission is ``policy_class``."""
    module = types.ModuleType("minserve_exercise_ch09_admission")
    module.SLOAdmission = policy_class
    return module


class AdmitsEverything(AdmissionPolicy):
    def __init__(self, ttft_slo_s: float, headroom: float = 0.5) -> None:
        self.ttft_slo_s, self.headroom = ttft_slo_s, headroom

    def decide(self, request, queue):
        return None


class RefusesEverything(AdmitsEverything):
    def decide(self, request, queue):
        return Refusal("ttft_slo", 1.0, "never")


class BorrowsTheAnswer(DeadlineAware):
    def __init__(self, ttft_slo_s: float, headroom: float = 0.5) -> None:
        super().__init__(headroom * ttft_slo_s)


@pytest.fixture(scope="module")
def no_admission_row():
    (row,) = overload_sweep(policies={"none": QueueLength(NO_ADMISSION)}, load_multiples=(3.0,))
    return row


@pytest.mark.parametrize("policy_class", [AdmitsEverything, RefusesEverything])
def test_admitting_or_refusing_everything_fails_the_goodput_test(policy_class, no_admission_row):
    with pytest.raises(AssertionError, match="goodput"):
        GRADED.test_goodput_at_three_times_capacity(_exercise(policy_class), no_admission_row)


def test_admitting_everything_fails_the_slo_and_refusing_fast():
    with pytest.raises(AssertionError, match="over the 1 s SLO"):
        GRADED.test_admitted_requests_meet_the_slo(_exercise(AdmitsEverything))
    with pytest.raises(AssertionError, match="refused 0 of the"):
        GRADED.test_refuses_fast_rather_than_failing_late(_exercise(AdmitsEverything))


def test_aiming_at_the_slo_itself_fails_the_admitted_requests_slo():
    solution = _load(EXERCISES / "solutions" / "ch09_admission.py", "solution_ch09")

    class AimsAtTheSLO(solution.SLOAdmission):
        def __init__(self, ttft_slo_s: float, headroom: float = 1.0) -> None:
            super().__init__(ttft_slo_s, headroom=1.0)

    with pytest.raises(AssertionError, match="over the 1 s SLO"):
        GRADED.test_admitted_requests_meet_the_slo(_exercise(AimsAtTheSLO))


def test_a_borrowed_policy_is_refused_by_the_rule_and_by_the_class_check():
    """The import rule itself is tested in tests/test_grade.py; here, what the loaded module may hold."""
    allowed = exercise_rules.ALLOWED_IMPORTS["ch09"]
    held = types.ModuleType("minserve_exercise_mine")
    held.AdmissionPolicy, held.Refusal, held.DeadlineAware = AdmissionPolicy, Refusal, DeadlineAware
    assert exercise_rules.foreign_names(held, allowed) == ["DeadlineAware (from minserve.admission)"]
    with pytest.raises(AssertionError, match="not a subclass of"):
        GRADED._policy(_exercise(BorrowsTheAnswer), 1.0)

"""Chapter 08's graded tests fail the common mistakes in a draft-and-verify step.

Each mistake is the reference solution with one line changed; the grader must take the points of the tests
named beside it (a verifier's mistake and a proposer's share a grading run: they fail different tests).
Only those tests run (``select``), so no mistake here needs the engine. (That the reference scores full
marks and the stub zero is checked for every chapter in tests/test_grade.py, and that the verifier
resampling from p instead of the residual falls below the pass line, public and hidden, too.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from minserve.grade import grade

SOLUTION = Path(__file__).resolve().parents[1] / "exercises" / "solutions" / "ch08_speculative.py"
MISTAKES = {
    "keeps every draft": (
        ("accepted = uniform * q_draft < p_draft", "accepted = uniform >= 0"),
        {"test_never_emits_a_token_the_target_rules_out", "test_keeps_as_many_drafts_as_exactness_allows",
         "test_disjoint_draft_and_target"},
    ),
    "accepts with q/p": (
        ("accepted = uniform * q_draft < p_draft", "accepted = uniform * p_draft < q_draft"),
        {"test_keeps_as_many_drafts_as_exactness_allows", "test_emitted_tokens_follow_the_target[1]"},
    ),
    "takes the bonus from the first row": (
        ("p_next = target_probs[rows, num_kept]", "p_next = target_probs[rows, num_kept % k]"),
        {"test_the_bonus_token_follows_the_next_distribution", "test_a_draft_the_target_likes_as_much_is_always_kept"},
    ),
    "forgets the bonus token": (
        ("out[rows, num_kept] = next_token",
         "out[rows, num_kept] = torch.where(num_kept < k, next_token, PLACEHOLDER)"),
        {"test_the_bonus_token_follows_the_next_distribution", "test_a_draft_the_target_likes_as_much_is_always_kept"},
    ),
    "proposes from the match itself, one token early": (
        ("self.follower[tuple(self.tokens[end - n : end])] = end",
         "self.follower[tuple(self.tokens[end - n : end])] = end - 1"),
        {"test_a_repeating_sequence_is_continued", "test_each_sequence_keeps_its_own_state"},
    ),
    "never forgets a released sequence": (
        ("self._indexes.pop(seq.request_id, None)", "pass"),
        {"test_each_sequence_keeps_its_own_state", "test_release_frees_what_was_kept"},
    ),
}  # fmt: skip


# A mistake in the verifier and one in the proposer share a grading run (a run costs a grader child, ~10 s):
# every test either one names calls only `verify` or only `LookupProposer` (checked below), so neither
# mistake can take the other's points.
RUNS = [
    ("keeps every draft", "proposes from the match itself, one token early"),
    ("accepts with q/p", "never forgets a released sequence"),
    ("takes the bonus from the first row",),
    ("forgets the bonus token",),
]
GRADED_TESTS = SOLUTION.parents[1] / "tests" / "test_ch08.py"


def test_every_mistake_is_graded_once_and_paired_mistakes_touch_different_functions():
    assert sorted(mistake for run in RUNS for mistake in run) == sorted(MISTAKES)
    for run in RUNS:
        used = [set().union(*(_exercise_names(name.split("[")[0]) for name in MISTAKES[m][1])) for m in run]
        assert len(run) == 1 or not set.intersection(*used), f"{run}: their tests call {used}"


def _exercise_names(test_name: str) -> set[str]:
    """What a graded test takes from the learner's module: ``exercise.verify`` → ``verify``; ``exercise`` handed
    on whole (to a helper, say) counts as every public name of the reference solution."""
    tree = ast.parse(GRADED_TESTS.read_text())
    test = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == test_name)
    names = {
        node.attr
        for node in ast.walk(test)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "exercise"
    }
    handed_on = any(
        isinstance(arg, ast.Name) and arg.id == "exercise"
        for node in ast.walk(test)
        if isinstance(node, ast.Call)
        for arg in [*node.args, *(k.value for k in node.keywords)]
    )
    if handed_on:
        solution = ast.parse(SOLUTION.read_text()).body
        return {n.name for n in solution if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name[0] != "_"}
    return names


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=" + ".join)
def test_each_mistake_loses_the_points_of_the_tests_that_check_it(run, tmp_path):
    source = SOLUTION.read_text()
    for mistake in run:
        (right, wrong), _ = MISTAKES[mistake]
        assert source.count(right) == 1, "the reference solution changed: update the mistake"
        source = source.replace(right, wrong)
    broken = tmp_path / "ch08_speculative.py"
    broken.write_text(source)
    names = {name.split("[")[0] for mistake in run for name in MISTAKES[mistake][1]}
    report, _ = grade("ch08", file=broken, select=" or ".join(sorted(names)))
    failed = {test.name for test in report.tests if test.points < test.max_points and test.outcome != "deselected"}
    for mistake in run:
        should_fail = MISTAKES[mistake][1]
        assert should_fail <= failed, f"a solution that {mistake} kept the points of {should_fail - failed}"

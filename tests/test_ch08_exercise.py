"""Chapter 08's graded tests fail the common mistakes in a draft-and-verify step, one mistake at a time.

Each mistake is the reference solution with one line changed; the grader must take the points of the tests
named beside it. Only those tests run (``select``), so no mistake here needs the engine. (That the reference
scores full marks and the stub zero is checked for every chapter in tests/test_grade.py, and that the
verifier resampling from p instead of the residual falls below the pass line, public and hidden, too.)
"""

from __future__ import annotations

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


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_loses_the_points_of_the_tests_that_check_it(mistake, tmp_path):
    (right, wrong), should_fail = MISTAKES[mistake]
    source = SOLUTION.read_text()
    assert source.count(right) == 1, "the reference solution changed: update the mistake"
    broken = tmp_path / "ch08_speculative.py"
    broken.write_text(source.replace(right, wrong))
    names = {name.split("[")[0] for name in should_fail}
    report, _ = grade("ch08", file=broken, select=" or ".join(sorted(names)))
    failed = {test.name for test in report.tests if test.points < test.max_points and test.outcome != "deselected"}
    assert should_fail <= failed, f"a solution that {mistake} kept the points of {should_fail - failed}"

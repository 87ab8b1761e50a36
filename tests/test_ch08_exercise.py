"""Chapter 08's graded tests fail the common mistakes in the verification step, one mistake at a time.

Each mistake is the reference solution with one line changed; the grader must take points from every one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from minserve.grade import grade

SOLUTION = Path(__file__).resolve().parents[1] / "exercises" / "solutions" / "ch08_speculative.py"
MISTAKES = {
    "resamples from p instead of the residual": (
        "return [*emitted, sample(residual(p, q), rng)]",
        "return [*emitted, sample(p, rng)]",
    ),
    "accepts with q/p": ("return min(1.0, p_x / q_x)", "return min(1.0, q_x / max(p_x, 1e-12))"),
    "takes the bonus from the first row": (
        "return [*emitted, sample(p_rows[-1], rng)]",
        "return [*emitted, sample(p_rows[0], rng)]",
    ),
    "leaves the residual unnormalised": (
        "return [x / total for x in left] if total > 0 else list(p)",
        "return left if total > 0 else list(p)",
    ),
}


def test_the_reference_solution_scores_full_marks():
    report, _ = grade("ch08", solutions=True)
    assert report.score == report.max_score > 0


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_loses_points(mistake, tmp_path):
    right, wrong = MISTAKES[mistake]
    source = SOLUTION.read_text()
    assert right in source, "the reference solution changed: update the mistake"
    broken = tmp_path / "ch08_speculative.py"
    broken.write_text(source.replace(right, wrong))
    report, _ = grade("ch08", file=broken)
    assert report.score < report.max_score, f"a solution that {mistake} got full marks"

"""Chapter 06's graded tests fail the common mistakes in splitting a layer, one mistake at a time.

Each mistake is the reference solution with one line changed; the grader must take points from the tests
named beside it. Only those tests run (``select``), so a mistake in splitting a weight spawns no rank; one
that needs the gloo tests spawns two ranks, hence slow. (That the reference solution itself scores full marks
is checked for every chapter in tests/test_grade.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from minserve.grade import grade

SOLUTION = Path(__file__).resolve().parents[1] / "exercises" / "solutions" / "ch06_parallel.py"
MISTAKES = {
    "splits the wrong dimension": (
        ("part = _part(weight.shape[0], rank, world_size, \"output features\")\n    return weight[part].clone()",
         "part = _part(weight.shape[1], rank, world_size, \"output features\")\n    return weight[:, part].clone()"),
        {"test_column_shard_keeps_output_rows", "test_shards_put_the_weight_back_together"},
    ),
    "all-reduces after the column layer too": (
        ("hidden = F.gelu(column_parallel_forward(x, up_weight_shard, up_bias_shard))",
         "hidden = F.gelu(all_reduce(column_parallel_forward(x, up_weight_shard, up_bias_shard)))"),
        {"test_mlp_over_gloo_equals_the_unsplit_mlp[mlp_tokens-leading0]",
         "test_one_all_reduce_of_the_output_size[mlp_tokens-7]"},
    ),
    "adds the bias on every rank": (
        ("if bias is not None and rank == 0:", "if bias is not None:"),
        {"test_row_parallel_partial_sums_add_up_to_the_full_layer",
         "test_row_parallel_over_gloo_gives_every_rank_the_full_output",
         "test_mlp_over_gloo_equals_the_unsplit_mlp[mlp_batch_tokens-leading1]"},
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_loses_the_points_of_the_tests_that_check_it(mistake, tmp_path):
    (right, wrong), should_fail = MISTAKES[mistake]
    source = SOLUTION.read_text()
    assert right in source, "the reference solution changed: update the mistake"
    broken = tmp_path / "ch06_parallel.py"
    broken.write_text(source.replace(right, wrong))
    names = {name.split("[")[0] for name in should_fail}
    report, _ = grade("ch06", file=broken, select=" or ".join(sorted(names)))
    failed = {test.name for test in report.tests if test.points < test.max_points and test.outcome != "deselected"}
    assert should_fail <= failed, f"a solution that {mistake} kept the points of {should_fail - failed}"
    assert report.score < report.max_score

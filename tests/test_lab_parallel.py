"""minserve.lab.parallel: the planner's table (the numbers `minserve plan parallel` prints), its figure and the
widget wired to them."""

from __future__ import annotations

import pytest

from minserve.capacity import interconnect, parallel, roofline
from minserve.lab import parallel as lab_parallel


@pytest.fixture(scope="module")
def table():
    return lab_parallel.planner_table("Llama-3-70B", "H100", 8, "nvlink4", batch=32, context_tokens=4096)


def test_table_rows_are_the_planners_layouts(table):
    plans = parallel.plan_parallel(
        "Llama-3-70B", roofline.hardware("H100"), 8, interconnect.interconnect("nvlink4"), 32, 4096
    )
    assert list(table["layout"]) == [plan.layout.name for plan in plans]
    assert (table["TP"] * table["PP"] * table["DP"] == 8).all()
    assert list(table["ms/token"]) == pytest.approx([plan.step_s * 1e3 for plan in plans])
    assert list(table["fits"]) == [plan.fits for plan in plans]
    assert list(table["dominant"]) == [plan.dominant for plan in plans]


def test_table_invariants(table):
    parts = table["work ms"] + table["communication ms"] + table["bubble ms"]
    assert list(parts) == pytest.approx(list(table["ms/token"]))
    assert list(table["work ms"]) == pytest.approx(list(table[["compute ms", "memory ms"]].max(axis=1)))
    assert list(table["tok/s"]) == pytest.approx(list(table["tok/s/replica"] * table["DP"]))
    assert list(table["tok/s/replica"]) == pytest.approx(list(32e3 / table["ms/token"]))


def test_figure_stacks_the_terms_and_greys_what_does_not_fit(table):
    fig = lab_parallel.planner_figure(table, "70B")
    stacked, throughput = fig.data[:3], fig.data[3]
    assert [trace.name for trace in stacked] == ["work", "communication", "bubble"]
    assert list(stacked[1].y) == list(table["communication ms"])
    assert list(throughput.y) == list(table["tok/s"])
    colors = dict(zip(table["layout"], throughput.marker.color))
    assert colors["DP8"] == lab_parallel.NO_FIT_COLOR != colors["TP8"]
    assert "DP8 (no fit)" in list(throughput.x) and fig.layout.barmode == "stack"


def test_widget_redraws_the_table_on_every_control():
    box = lab_parallel.parallelism_planner(batch=4)
    model, _gpu, count, link, batch, _context, _figure, readout = box.children
    expected = lab_parallel.planner_table("Llama-3-70B", "H100", 8, "nvlink4", 4, 4096)
    assert readout.value == lab_parallel.planner_summary_html(expected) and ">TP4×PP2<" in readout.value
    count.value = 16  # TP up to 8 (8 KV heads), the rest pipeline stages or replicas
    assert ">TP8×DP2<" in readout.value and ">TP16<" not in readout.value
    model.value, link.value, batch.value = "Qwen3-0.6B", "pcie4", 2
    expected = lab_parallel.planner_table("Qwen3-0.6B", "H100", 16, "pcie4", 2, 4096)
    assert readout.value == lab_parallel.planner_summary_html(expected)

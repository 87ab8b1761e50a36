"""minserve.lab: the theme, the figure and table helpers, and the pure functions behind the widgets."""

from __future__ import annotations

import random

import plotly.io as pio
import pytest

from minserve import lab, slo
from minserve.lab import widgets
from minserve.slo import SLO, RequestRecord

CHAT = SLO("chat", ttft_s=0.3, tpot_s=0.05)
BATCH = SLO("batch", ttft_s=30.0, tpot_s=1.0)


def _records(seed: int = 0, n: int = 30) -> list[RequestRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        times = [i + rng.uniform(0.05, 0.6)]
        for _ in range(rng.randint(0, 11)):
            times.append(times[-1] + rng.uniform(0.01, 0.1))
        records.append(RequestRecord(float(i), times, status=rng.choice(["ok"] * 8 + ["failed", "cancelled"])))
    return records


def test_course_theme_becomes_the_default():
    name = lab.use_course_theme()
    assert name == lab.TEMPLATE_NAME and pio.templates.default == name
    assert list(pio.templates[name].layout.colorway) == lab.theme.COLORWAY


def test_ecdf_points():
    xs, ys = slo.ecdf_points([3.0, 1.0, 2.0, 2.0])
    assert xs == [1.0, 2.0, 2.0, 3.0] and ys == [0.25, 0.5, 0.75, 1.0]
    assert slo.ecdf_points([]) == ([], [])


def test_ecdf_figure_plots_the_data_and_each_contracts_line():
    records = _records()
    fig = lab.latency_ecdf(records, "ttft", [CHAT, BATCH, SLO("e2e only", e2e_s=9.0)])
    expected_ms = sorted(v * 1e3 for v in slo.metric_values_s(records, "ttft"))
    assert list(fig.data[0].x) == pytest.approx(expected_ms)
    slo_lines = [s for s in fig.layout.shapes if s.line.dash == "dash"]
    assert sorted(s.x0 for s in slo_lines) == pytest.approx([300.0, 30000.0])  # no TTFT line for "e2e only"
    assert fig.layout.template.layout.colorway == pio.templates[lab.TEMPLATE_NAME].layout.colorway


def test_histogram_draws_tpot_target_on_itl_and_percentiles():
    records = _records(1)
    fig = lab.latency_histogram(records, "itl", [CHAT])
    assert len(fig.data[0].x) == len(slo.metric_values_s(records, "itl"))
    xs = sorted(s.x0 for s in fig.layout.shapes)
    itl_ms = [v * 1e3 for v in slo.metric_values_s(records, "itl")]
    assert xs == pytest.approx(sorted([slo.percentile(itl_ms, 50), slo.percentile(itl_ms, 99), 50.0]))


def test_figures_of_an_empty_run_do_not_fail():
    assert len(lab.latency_histogram([], "e2e").data[0].x or ()) == 0
    assert len(lab.latency_ecdf([], "e2e").data[0].x) == 0


def test_tables():
    records = _records(2)
    table = lab.percentile_table(records)
    assert table.loc["ttft_ms", "p50"] == pytest.approx(slo.summary_table(records).loc["ttft_ms", "p50"], abs=0.05)
    contracts = lab.contract_table(records, [CHAT, BATCH], usd_per_accelerator_hour=1.0)
    assert list(contracts.index) == ["chat", "batch"]
    assert contracts.loc["chat", "goodput_rps"] == pytest.approx(slo.goodput_rps(records, CHAT))
    assert contracts.loc["batch", "attainment_all"] >= contracts.loc["chat", "attainment_all"]


def test_attainment_for_thresholds_agrees_with_slo():
    records = _records(3)
    result = lab.attainment_for_thresholds(records, ttft_ms=300, tpot_ms=50)
    assert result == pytest.approx(
        slo.attainment(records, CHAT)
        | {"goodput_rps": slo.goodput_rps(records, CHAT), "request_throughput_rps": slo.request_throughput_rps(records)}
    )


def test_tightening_a_threshold_never_raises_attainment():
    records = _records(4)
    for tpot_ms in (10, 40, 200):
        previous = None
        for ttft_ms in range(1000, 0, -50):  # tighter and tighter
            result = lab.attainment_for_thresholds(records, ttft_ms, tpot_ms)
            assert result["goodput_rps"] <= result["request_throughput_rps"]
            if previous is not None:
                assert result["all"] <= previous["all"] and result["ttft"] <= previous["ttft"]
            previous = result


def test_slider_range():
    low, high, step = widgets.slider_range_ms([0.2, 0.4])  # largest 400 ms, 1.5 × headroom
    assert low == step == 1.0 and high >= 600.0
    assert widgets.slider_range_ms([]) == (0.01, 1.0, 0.01)
    # The slider's lowest value is still a valid contract (an SLO refuses a bound of 0).
    assert widgets.attainment_for_thresholds(_records(), low, low)["all"] >= 0


def test_summary_html_shows_every_number():
    result = {"ttft": 0.5, "tpot": 0.25, "all": 0.125, "goodput_rps": 1.5, "request_throughput_rps": 3}
    html = widgets.summary_html(result)
    for text in ("50%", "25%", "12%", "1.50 req/s", "3.00 req/s"):
        assert text in html


def test_slo_explorer_updates_when_a_slider_moves():
    records = _records(5)
    box = lab.slo_explorer(records, ttft_ms=300, tpot_ms=50)
    ttft, tpot, readout = box.children
    assert readout.value == widgets.summary_html(lab.attainment_for_thresholds(records, 300, 50))
    ttft.value, tpot.value = ttft.max, tpot.max
    assert readout.value == widgets.summary_html(lab.attainment_for_thresholds(records, ttft.max, tpot.max))
    assert readout.value != widgets.summary_html(lab.attainment_for_thresholds(records, 300, 50))


def test_setup_notebook_sets_theme_and_renderer():
    lab.setup_notebook()
    assert pio.templates.default == lab.TEMPLATE_NAME
    assert "plotly_mimetype" in pio.renderers.default

"""minserve.lab.render: figures carry the live mimetype and site HTML without plotly.js, deterministically."""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from minserve.lab.render import DEFAULT_RENDERERS, configure_renderer


@pytest.fixture
def renderer():
    previous = pio.renderers.default
    configure_renderer()
    yield
    pio.renderers.default = previous


def _bundle(fig: go.Figure) -> dict:
    return pio.renderers._build_mime_bundle(fig.to_dict())


def test_a_figure_carries_the_mimetype_and_html_without_plotlyjs(renderer) -> None:
    bundle = _bundle(go.Figure(go.Scatter(x=[1, 2], y=[3, 4])))
    assert pio.renderers.default == DEFAULT_RENDERERS
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html"}
    html = bundle["text/html"]
    assert "Plotly.newPlot" in html
    assert "<script src" not in html  # neither plotly.js nor MathJax from a CDN
    assert len(html) < 50_000  # plotly.js itself is ~4.8 MB


def test_div_ids_are_stable_between_runs_and_distinct_within_one(renderer) -> None:
    fig = go.Figure(go.Bar(x=["a"], y=[1]))
    first, second = _bundle(fig)["text/html"], _bundle(fig)["text/html"]
    assert first != second  # the same figure twice in a notebook gets two divs
    configure_renderer()  # a fresh kernel: the counter starts again
    assert _bundle(fig)["text/html"] == first

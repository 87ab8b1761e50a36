"""Open the built site in a real headless chromium: every chapter's charts draw and its widget shows, offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CHAPTERS

CHART_DIV = ".plotly-graph-div"  # what plotly's to_html writes, drawn or not
CHART_SVG = ".js-plotly-plot svg.main-svg"  # what plotly.js adds once it has drawn the chart
# JS: has plotly.js drawn this chart div? (_fullData is the traces it laid out, of any trace type)
_DRAWN = "d => d.querySelector('svg.main-svg') !== null && (d._fullData || []).length > 0"
CHART_TIMEOUT_MS = 60_000  # plotly.js is 4.8 MB to parse on a busy 2-core machine
WIDGET = ".minserve-widget"  # a widget as scripts/build_site.py draws it from the saved widget state
CONTROLS = "select, input, textarea, button"


def test_home_page_lists_chapter_01(page, site_url: str) -> None:
    page.goto(site_url)
    link = page.locator("article a[href*='chapters/01_']").first
    assert link.count() == 1
    link.click()
    page.wait_for_load_state("load")
    assert "/chapters/01_" in page.url
    assert page.remote_requests == []


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_shows_its_charts_and_its_widget(page, site_url: str, chapter: str, artifacts_dir: Path) -> None:
    """Every chart div is drawn by plotly.js (an SVG with its traces), and the widget is on screen: a live
    explorer (tests/site/test_explorers.py moves it) with its controls enabled, or a widget drawn as the
    chapter left it, its controls disabled; either way with a readout that says something, a chart or text."""
    page.goto(f"{site_url}chapters/{chapter}/")
    charts = page.locator(CHART_DIV).count()
    assert charts >= 1, f"{chapter} shows no chart"
    # Wait until every chart div (not just the first) has been drawn by plotly.js: an SVG and its traces.
    page.wait_for_function(f"[...document.querySelectorAll('{CHART_DIV}')].every({_DRAWN})", timeout=CHART_TIMEOUT_MS)
    assert page.locator(CHART_SVG).count() >= charts

    widget = page.locator(WIDGET).first
    assert page.locator(WIDGET).count() >= 1, f"{chapter} shows no widget"
    widget.scroll_into_view_if_needed()
    assert widget.is_visible() and widget.bounding_box()["height"] > 40
    # Each control's `disabled`, leaving out what plotly.js draws inside a chart of the widget's.
    disabled = widget.evaluate(f"w => [...w.querySelectorAll('{CONTROLS}')].filter(e => !e.closest('.js-plotly-plot'))"
                               ".map(e => e.disabled)")  # fmt: skip
    live = "minserve-explorer" in (widget.get_attribute("class") or "")
    want = not all(disabled) if live else all(disabled)
    assert disabled and want, f"{chapter}: the widget's controls {disabled} (live: {live})"
    readout = widget.locator(".minserve-widget-readout")
    shown = [
        readout.nth(i).inner_text().strip() or readout.nth(i).locator(CHART_DIV).count() for i in range(readout.count())
    ]
    assert any(shown), f"{chapter}: the widget's readout is empty"
    assert page.locator(".minserve-widget-note").first.is_visible()

    widget.screenshot(path=str(artifacts_dir / f"{chapter}-widget.png"))
    page.locator(CHART_DIV).first.screenshot(path=str(artifacts_dir / f"{chapter}-chart.png"))
    page.screenshot(path=str(artifacts_dir / f"{chapter}-page.png"))
    assert page.remote_requests == []
    assert page.js_errors == []

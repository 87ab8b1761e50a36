"""Open the built site in a real headless chromium and check that the chapter charts draw, offline."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

CHART_DIV = ".plotly-graph-div"  # what plotly's to_html writes, drawn or not
CHART_SVG = ".js-plotly-plot svg.main-svg"  # what plotly.js adds once it has drawn the chart
# JS: has plotly.js drawn this chart div? (_fullData is the traces it laid out, of any trace type)
_DRAWN = "d => d.querySelector('svg.main-svg') !== null && (d._fullData || []).length > 0"
CHART_TIMEOUT_MS = 60_000  # plotly.js is 4.8 MB to parse on a busy 2-core machine


@pytest.fixture
def page(browser_context, site_url: str):
    """A fresh tab that records every request leaving 127.0.0.1 (and refuses it) and every JS error."""
    tab = browser_context.new_page()
    tab.remote_requests, tab.js_errors = [], []

    def route(route):
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            tab.remote_requests.append(route.request.url)
            route.abort()

    tab.route("**/*", route)
    tab.on("pageerror", lambda error: tab.js_errors.append(str(error)))
    yield tab
    tab.close()


def test_home_page_lists_chapter_01(page, site_url: str) -> None:
    page.goto(site_url)
    link = page.locator("article a[href*='chapters/01_']").first
    assert link.count() == 1
    link.click()
    page.wait_for_load_state("load")
    assert "/chapters/01_" in page.url
    assert page.remote_requests == []


def test_chapter_01_charts_render(page, site_url: str, site_dir: Path, artifacts_dir: Path) -> None:
    page.goto(site_url + _chapter_path(site_dir, "01_"))
    charts = page.locator(CHART_DIV).count()
    assert charts >= 1, "chapter 01 shows no chart"
    # Wait until every chart div (not just the first) has been drawn by plotly.js: an SVG and its traces.
    page.wait_for_function(f"[...document.querySelectorAll('{CHART_DIV}')].every({_DRAWN})", timeout=CHART_TIMEOUT_MS)
    assert page.locator(CHART_SVG).count() >= charts

    first_chart = page.locator(CHART_DIV).first
    first_chart.scroll_into_view_if_needed()
    first_chart.screenshot(path=str(artifacts_dir / "chapter01-chart.png"))
    page.screenshot(path=str(artifacts_dir / "chapter01-page.png"))
    assert page.remote_requests == []
    assert page.js_errors == []


def _chapter_path(site_dir: Path, prefix: str) -> str:
    matches = sorted(p.parent.name for p in (site_dir / "chapters").glob(f"{prefix}*/index.html"))
    assert matches, f"no chapter {prefix}* in {site_dir / 'chapters'}"
    return f"chapters/{matches[0]}/"

"""The built site works with no internet: every script, stylesheet and font it loads is its own."""

from __future__ import annotations

import re
from pathlib import Path

# What a page *loads* (not what it links to): script and img sources, stylesheets, and JS module imports.
_REMOTE_LOAD = re.compile(
    r"""<script[^>]*\ssrc=["'](?:https?:)?//[^"']*"""
    r"""|<link[^>]*rel=["']?(?:stylesheet|preload|modulepreload)[^>]*href=["'](?:https?:)?//[^"']*"""
    r"""|<link[^>]*href=["'](?:https?:)?//[^"']*["'][^>]*rel=["']?(?:stylesheet|preload|modulepreload)"""
    r"""|<img[^>]*\ssrc=["'](?:https?:)?//[^"']*"""
    r"""|import\(["'](?:https?:)?//[^"']*""",
    re.IGNORECASE,
)
_CDN = re.compile(r"""["'](?:https?:)?//[^"']*\bcdn[\w.-]*\.[^"']*""", re.IGNORECASE)


def _pages(site_dir: Path) -> list[Path]:
    return sorted(site_dir.rglob("*.html"))


def test_no_page_loads_anything_from_another_host(site_dir: Path) -> None:
    offenders = {
        str(page.relative_to(site_dir)): _REMOTE_LOAD.findall(page.read_text(encoding="utf-8"))
        for page in _pages(site_dir)
    }
    assert {page: hits for page, hits in offenders.items() if hits} == {}


def test_no_page_names_a_cdn(site_dir: Path) -> None:
    offenders = {
        str(page.relative_to(site_dir)): _CDN.findall(page.read_text(encoding="utf-8")) for page in _pages(site_dir)
    }
    assert {page: hits for page, hits in offenders.items() if hits} == {}


def test_chapter_pages_load_the_sites_own_plotly(site_dir: Path) -> None:
    chapters = sorted((site_dir / "chapters").glob("*/index.html"))
    assert chapters, "the site has no chapter pages"
    for page in chapters:
        html = page.read_text(encoding="utf-8")
        scripts = re.findall(r"""<script src="([^"]*plotly[^"]*\.js)""", html)
        assert len(scripts) == 1, f"{page}: expected one plotly.js script, found {scripts}"
        assert (page.parent / scripts[0]).resolve().is_file(), f"{page}: {scripts[0]} is not in the site"
        # Each chart is a div and a newPlot call; plotly.js itself is never inlined into a page.
        assert "window.PlotlyConfig" not in html and len(html) < 2_000_000, f"{page}: plotly.js inlined?"

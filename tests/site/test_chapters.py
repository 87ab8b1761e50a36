"""Every chapter page of the built site shows what the chapter showed when it ran: charts and its widget.

The site is the learner's view without running anything, so a chapter rendered without outputs (not
executed, or executed from another version of the notebook), or a widget shown as its repr or as nothing,
fails here. tests/site/test_browser.py checks the same pages drawn in a real browser.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted(path.stem for path in (ROOT / "chapters").glob("*.ipynb"))
_CONTROL = re.compile(r"<(?:select|input|textarea|button)\b[^>]*\b(?:disabled|data-control=)")


def chapter_html(site_dir: Path, chapter: str) -> str:
    page = site_dir / "chapters" / chapter / "index.html"
    assert page.is_file(), f"the site has no page for {chapter}"
    return page.read_text(encoding="utf-8")


def widget_blocks(html: str) -> list[str]:
    """Each static widget's HTML, from its opening div to the note after it."""
    return re.findall(r'<div class="minserve-widget[" ].*?<p class="minserve-widget-note">', html, re.S)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_page_shows_its_charts(site_dir: Path, chapter: str) -> None:
    html = chapter_html(site_dir, chapter)
    charts = html.count('class="plotly-graph-div"')
    assert charts >= 1, f"{chapter} shows no chart: was it executed (make site)?"
    assert html.count("Plotly.newPlot(") >= charts, f"{chapter}: a chart div without the call that draws it"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_page_shows_its_widget_as_it_was_left(site_dir: Path, chapter: str) -> None:
    html = chapter_html(site_dir, chapter)
    widgets = widget_blocks(html)
    assert widgets, f"{chapter} shows no widget"
    for widget in widgets:
        assert _CONTROL.search(widget), f"{chapter}: a widget without its controls"
        # Everything from each readout on (a readout nests divs of its own): its text, or a chart.
        readouts = widget.split('<div class="minserve-widget-readout">')[1:]
        shown = [r for r in readouts if re.sub(r"<[^>]+>", "", _CONTROL.sub("", r)).strip() or "plotly-graph-div" in r]
        assert shown, f"{chapter}: a widget whose readout is empty"
    assert "children=(" not in html, f"{chapter} shows a widget's repr"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_page_says_where_it_sits_and_how_to_run_it(site_dir: Path, chapter: str) -> None:
    """docs/hooks/chapter_frame.py: chapter n of N with previous and next, the outline, the references, and
    `make lab`, the exercise and its `minserve grade` line."""
    html = chapter_html(site_dir, chapter)
    number, total = CHAPTERS.index(chapter) + 1, len(CHAPTERS)
    assert f"Chapter {number} of {total}" in html
    if number > 1:
        assert f'previous: <a href="../{CHAPTERS[number - 2]}/">' in html
    if number < total:
        assert f'next: <a href="../{CHAPTERS[number]}/">' in html
    assert html.count("(you are here)") == 1
    assert 'href="#references"' in html if 'id="references"' in html else True
    assert "<code>make lab</code>" in html
    exercise = next((ROOT / "exercises").glob(f"ch{chapter[:2]}_*.py"))
    assert f"exercises/{exercise.name}" in html and f"minserve grade ch{chapter[:2]}" in html

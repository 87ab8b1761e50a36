"""mkdocs hook: each chapter page says where it sits in the course and how to run it, as a book would.

Above the chapter: "Chapter n of N", the previous and next chapters, the whole outline (folded), and a link
to the chapter's references when it has a References section. Below it: how to run it yourself, with
`make lab`, the chapter's exercise in exercises/ and its `minserve grade chNN` line (minserve/grade.py).
All of it comes from the nav's Chapters section and the exercises folder, so a new chapter needs no edit here.
"""

from __future__ import annotations

import html
from pathlib import Path

CHAPTERS_SECTION = "Chapters"
_chapters: list = []  # the chapter pages, in nav order


def on_nav(nav, config, files):
    _chapters.clear()
    for section in nav.items:
        if section.is_section and section.title == CHAPTERS_SECTION:
            _chapters.extend(page for page in section.children if page.is_page)
    return nav


def on_page_content(content: str, page, config, files) -> str:
    position = next((i for i, p in enumerate(_chapters) if p.file.src_uri == page.file.src_uri), None)
    if position is None:
        return content
    root = Path(config.config_file_path).parent
    return course_header(page, position, 'id="references"' in content) + content + run_it(page, root)


def _link(page, target) -> str:
    return f'<a href="{html.escape(target.file.url_relative_to(page.file))}">{html.escape(target.title)}</a>'


def course_header(page, position: int, has_references: bool) -> str:
    """Chapter n of N, previous and next, the outline (this chapter marked), and the references link."""
    previous = _chapters[position - 1] if position > 0 else None
    following = _chapters[position + 1] if position + 1 < len(_chapters) else None
    steps = [f"Chapter {position + 1} of {len(_chapters)}"]
    steps.append(f"previous: {_link(page, previous)}" if previous else "the first chapter")
    steps.append(f"next: {_link(page, following)}" if following else "the last chapter")
    if has_references:
        steps.append('<a href="#references">references</a>')
    here = "<li><strong>{}</strong> (you are here)</li>"
    outline = "".join(
        here.format(html.escape(p.title)) if i == position else f"<li>{_link(page, p)}</li>"
        for i, p in enumerate(_chapters)
    )
    return (
        '<nav class="minserve-course-position" aria-label="where this chapter sits in the course">'
        f"<p>{' · '.join(steps)}</p>"
        f"<details><summary>The course outline</summary><ol>{outline}</ol></details></nav>"
    )


def run_it(page, root: Path) -> str:
    """How to run this chapter and grade its exercise, from the repository root."""
    number = Path(page.file.src_uri).name[:2]
    exercise = next(iter(sorted((root / "exercises").glob(f"ch{number}_*.py"))), None)
    notebook = f"chapters/{Path(page.file.src_uri).name}"
    lines = [
        "<li>Run it yourself: <code>make lab</code> opens JupyterLab on the chapters (it prints the URL to"
        f" open); open <code>{html.escape(notebook)}</code> and run all cells. Every explorer then answers"
        " for any value, from the engine itself.</li>"
    ]
    if exercise is not None:
        lines.append(
            f"<li>The exercise: fill in <code>exercises/{html.escape(exercise.name)}</code>, then grade it with"
            f" <code>minserve grade ch{number}</code> (<code>--verbose</code> for the tracebacks); see"
            f' <a href="{html.escape(_exercises_url(page))}">Exercises</a>.</li>'
        )
    return (
        '<div class="admonition tip minserve-run-it"><p class="admonition-title">Run this chapter</p>'
        f"<ul>{''.join(lines)}</ul></div>"
    )


def _exercises_url(page) -> str:
    return "../../exercises/" if page.file.use_directory_urls else "../exercises.html"

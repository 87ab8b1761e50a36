"""mkdocs hook for the minserve course site: chapters from chapters/, plotly.js served locally, nothing remote.

* The chapter notebooks live in ``chapters/`` (committed without outputs), outside ``docs/``. This hook adds
  them to the site as ``chapters/NAME.ipynb``; mkdocs-jupyter renders them. It renders the *executed* copy
  that ``scripts/build_site.py`` writes to ``build/executed/chapters/`` when that copy was made from the
  notebook as it is now, and otherwise the bare notebook, with a warning (so ``--strict`` fails).
* plotly.js: the installed plotly package's own ``plotly.min.js`` is copied into the site once; the theme
  override (``docs/overrides/main.html``) loads it on the pages that show charts.
* nbconvert's HTML names MathJax and mermaid.js on a CDN. The site has to work offline, so those loaders
  are taken out of the chapter pages, and any page still naming a remote script is a warning.
* The home page's chapter list is made from the nav, so adding a chapter is one line in ``mkdocs.yml``.

``MINSERVE_CHAPTERS_DIR`` (here and in scripts/build_site.py) points at another folder named ``chapters``,
to try the site on notebooks that are not the course's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import plotly
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.minserve_site")

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
# The version in the file name makes a browser fetch the new library after an upgrade.
PLOTLY_JS_URI = f"assets/javascripts/plotly-{plotly.__version__}.min.js"
EXECUTED_DIR = Path("build/executed")
CHAPTER_LIST_MARKER = "<!-- chapter-list -->"
CHAPTERS_SECTION = "Chapters"

# mkdocs-jupyter leaves an empty loader (`<script src="">`) when no MathJax URL is set; nbconvert's own names a CDN.
_MATHJAX_LOADER = re.compile(r'<script src="(?:https?://[^"]*mathjax[^"]*)?">\s*</script>', re.IGNORECASE)
_MERMAID_LOADER = re.compile(r'<script type="module">(?:(?!</script>).)*?mermaid(?:(?!</script>).)*</script>', re.S)
_REMOTE_SCRIPT = re.compile(r"""<script[^>]+src=["'](?:https?:)?//|import\(["'](?:https?:)?//""", re.IGNORECASE)

_chapters_nav: list[tuple[str, str]] = []  # (title, src_uri) of each chapter, in nav order


def source_sha256(path: Path) -> str:
    """The fingerprint scripts/build_site.py stamps on an executed copy (keep the two the same)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def on_config(config):
    config.extra["plotly_js"] = PLOTLY_JS_URI
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, so it sees the chapters as notebooks
def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).parent
    chapters_dir = Path(os.environ.get("MINSERVE_CHAPTERS_DIR", root / "chapters"))
    executed_root = root / EXECUTED_DIR
    for source in sorted(chapters_dir.glob("*.ipynb")):
        uri = f"chapters/{source.name}"  # the page's path in the site; the src_dir holds a chapters/ folder
        if _is_fresh(executed_root / uri, source):
            src_dir = executed_root
        else:
            src_dir = chapters_dir.parent
            log.warning(f"{uri} is rendered without outputs: run `make site` to execute it first")
        files.append(File(uri, str(src_dir), config.site_dir, config.use_directory_urls))
    return files


def _is_fresh(executed: Path, source: Path) -> bool:
    if not executed.is_file():
        return False
    stamp = json.loads(executed.read_text(encoding="utf-8")).get("metadata", {}).get("minserve", {})
    return stamp.get("source_sha256") == source_sha256(source)


def on_nav(nav, config, files):
    _chapters_nav.clear()
    for section in nav.items:
        if section.is_section and section.title == CHAPTERS_SECTION:
            _chapters_nav.extend((page.title, page.file.src_uri) for page in section.children if page.is_page)
    return nav


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CHAPTER_LIST_MARKER not in markdown:
        return markdown
    # Links are relative to the page holding the marker (the home page, at the docs root).
    items = "\n".join(f"{i}. [{title}]({uri})" for i, (title, uri) in enumerate(_chapters_nav, 1))
    return markdown.replace(CHAPTER_LIST_MARKER, items or "*No chapter yet.*")


def on_page_content(html: str, page, config, files) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    return _MERMAID_LOADER.sub("", _MATHJAX_LOADER.sub("", html))


def on_post_page(output: str, page, config) -> str:
    if _REMOTE_SCRIPT.search(output):
        log.warning(f"{page.file.src_uri}: the page loads a script from another host; the site must work offline")
    return output


def on_post_build(config) -> None:
    target = Path(config.site_dir) / PLOTLY_JS_URI
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLOTLY_JS, target)

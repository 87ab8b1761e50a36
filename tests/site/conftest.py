"""Fixtures for the checks of the built course site (site/, made by `make site`) and of JupyterLab in a browser.

These tests need the built site (test_lab.py needs JupyterLab instead), and the browser tests need Debian's
chromium and Python Playwright.
`make test-site` builds the site first and sets MINSERVE_REQUIRE_SITE=1, which turns a missing
prerequisite into a failure; anywhere else (a plain `pytest`) a missing one skips, with the reason.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE_DIR = ROOT / "site"
ARTIFACTS_DIR = ROOT / "test-artifacts" / "site"
CHAPTERS = sorted(path.stem for path in (ROOT / "chapters").glob("*.ipynb"))
# Flags that let Debian's chromium run headless as root in a container, and keep it from calling home.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def missing(reason: str) -> None:
    """Fail under `make test-site`, skip elsewhere."""
    if os.environ.get("MINSERVE_REQUIRE_SITE") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def site_dir() -> Path:
    if not (SITE_DIR / "index.html").is_file():
        missing(f"no built site in {SITE_DIR}: run `make site`")
    return SITE_DIR


@pytest.fixture(scope="session")
def site_url(site_dir: Path) -> Iterator[str]:
    """The built site served on 127.0.0.1, on a free port, for the length of the session."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per request would drown pytest -v
        pass


@pytest.fixture(scope="session")
def browser_context(tmp_path_factory: pytest.TempPathFactory):
    """A headless chromium (Debian's, never a Playwright download) with a fresh profile."""
    executable = shutil.which("chromium")
    if executable is None:
        missing("chromium is not installed: run `make browser`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Python Playwright is not installed (pip install playwright; never `playwright install`)")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS_DIR


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

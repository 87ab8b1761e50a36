"""A chapter as a learner meets it: JupyterLab, driven in a real chromium, runs it with its own kernel and its
own widget manager; then nothing failed, every plotly figure is drawn, every widget is controls (not a text
repr), and moving a control of the explorer changes what it shows. Screenshots go to test-artifacts/lab/.

JupyterLab is started by the test on 127.0.0.1 (a free port, a random token, settings and workspaces in a
temporary folder) on a copy of the chapter, so nothing it saves touches chapters/; it is stopped after.
`make test-site` runs one small chapter (LAB_CHAPTERS below); `make test-lab` runs them all
(MINSERVE_LAB_CHAPTERS=all, or a comma-separated list of chapter names).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import CHAPTERS, ROOT, missing

LAB_ARTIFACTS = ROOT / "test-artifacts" / "lab"
# The chapter `make test-site` walks through: small, quick on 2 cores, with an explorer of dropdowns.
LAB_CHAPTERS = ["04_kv_cache"]
CHAPTER_TIMEOUT_S = int(os.environ.get("MINSERVE_LAB_TIMEOUT_S", "480"))  # Run All, on a busy 2-core machine
# JS: tracebacks in the outputs (JupyterLab draws an error like stderr; its text names the exception).
_ERRORS = """() => [...document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(e => e.innerText).filter(t => /Traceback|^\\w+(Error|Exception)\\b/m.test(t)).map(t => t.slice(0, 500))"""
# JS: every code cell has run (a number in its prompt, none waiting as [*]), or one failed (Run All stops).
_DONE = f"""() => {{
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(p => p.innerText.trim());
  const ran = prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p));
  return ran || ({_ERRORS})().length > 0;
}}"""
# JS: the code cells without a run number, by their prompt and first line (what a timeout reports).
_NOT_RUN = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')]
  .map(c => [c.querySelector('.jp-InputPrompt')?.innerText.trim(),
             (c.querySelector('.jp-InputArea-editor')?.innerText || '').split('\\n')[0].slice(0, 80)])
  .filter(([p]) => !/\\[\\d+\\]/.test(p || ''))"""
_DRAWN = "d => d.querySelector('svg.main-svg') !== null && (d._fullData || []).length > 0"
# Settings a learner's JupyterLab would not need: every cell kept in the page (so all of it can be checked),
# and no news fetched from the internet.
_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


def _chapters() -> list[str]:
    chosen = os.environ.get("MINSERVE_LAB_CHAPTERS", "")
    if chosen == "all":
        return CHAPTERS
    return [c.strip() for c in chosen.split(",") if c.strip()] or LAB_CHAPTERS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """JupyterLab on 127.0.0.1 over a folder of chapter copies: (base URL with its token, that folder)."""
    jupyter = Path(sys.executable).parent / "jupyter"
    if not jupyter.exists():
        missing("JupyterLab is not installed in this environment (pip install -e '.[all]')")
    home = tmp_path_factory.mktemp("lab")
    notebooks, settings = home / "chapters", home / "settings"
    notebooks.mkdir()
    for name, values in _SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    command = [str(jupyter), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebooks}",
               f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={home / 'workspaces'}"]  # fmt: skip
    if os.geteuid() == 0:
        command.append("--allow-root")
    log = (home / "lab.log").open("w")
    server = subprocess.Popen(command, cwd=notebooks, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(f"{base}/api/status?token={token}", server)
        yield f"{base}/{{path}}?token={token}", notebooks
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _wait_until_up(url: str, server: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited with {server.returncode} before it answered")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer {url} within {timeout_s:.0f} s")


@pytest.mark.timeout(CHAPTER_TIMEOUT_S + 240)  # pytest-timeout's default would cut a long chapter short
@pytest.mark.parametrize("chapter", _chapters())
def test_chapter_runs_in_jupyterlab(page, lab, chapter: str) -> None:
    url, notebooks = lab
    shutil.copy(ROOT / "chapters" / f"{chapter}.ipynb", notebooks)
    LAB_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1400, "height": 1000})
    try:
        _walk_through(page, url, chapter)
    finally:  # the next chapter starts alone, as a learner's fresh session would: no kernel left running
        _shut_down_kernels(url)


def _walk_through(page, url: str, chapter: str) -> None:
    # A workspace of its own, so the page holds this chapter's notebook and no earlier one's.
    page.goto(url.format(path=f"lab/workspaces/{chapter}/tree/{chapter}.ipynb"))
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=120_000)
    _accept_kernel(page)
    # Run all cells through JupyterLab's own menu, as a learner would.
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    start = time.monotonic()
    try:
        page.wait_for_function(_DONE, timeout=CHAPTER_TIMEOUT_S * 1000, polling=1000)
    except PlaywrightTimeout:
        pytest.fail(f"{chapter}: not every cell ran within {CHAPTER_TIMEOUT_S} s: {page.evaluate(_NOT_RUN)}")
    finally:  # finished or not, what the learner would see
        took_s = time.monotonic() - start
        page.screenshot(path=str(LAB_ARTIFACTS / f"{chapter}-end.png"))

    assert page.evaluate(_ERRORS) == [], f"{chapter}: an error in JupyterLab after {took_s:.0f} s"
    charts = page.locator(".jp-Notebook .js-plotly-plot")
    assert charts.count() >= 1, f"{chapter}: no plotly figure drawn in JupyterLab"
    page.wait_for_function(f"[...document.querySelectorAll('.jp-Notebook .js-plotly-plot')].every({_DRAWN})",
                           timeout=60_000)  # fmt: skip
    widgets = page.locator(".jp-Notebook .jupyter-widgets.widget-container, .jp-Notebook .widget-vbox")
    assert widgets.count() >= 1, f"{chapter}: no widget rendered as controls"
    assert "children=(" not in page.locator(".jp-Notebook").inner_text(), f"{chapter}: a widget shown as its repr"
    _move_a_control(page, chapter)


def _shut_down_kernels(url: str) -> None:
    """Stop every kernel the JupyterLab server runs (its REST API): each holds a chapter's models in memory."""
    with urllib.request.urlopen(url.format(path="api/kernels"), timeout=30) as response:
        kernels = json.load(response)
    for kernel in kernels:
        request = urllib.request.Request(url.format(path=f"api/kernels/{kernel['id']}"), method="DELETE")
        urllib.request.urlopen(request, timeout=60).close()


def _accept_kernel(page) -> None:
    """JupyterLab may ask which kernel to start (a notebook it has not seen): take the one it proposes, the
    environment's Python 3. Then wait until that kernel is idle."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    try:
        dialog.wait_for(timeout=20_000)
        dialog.click()
    except PlaywrightTimeout:
        pass  # no question asked: the kernel starts by itself
    page.wait_for_function(
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]') !== null",
        timeout=120_000,
    )


def _move_a_control(page, chapter: str) -> None:
    """Pick another option of the explorer's first dropdown (or nudge its first slider): its output changes."""
    explorer = page.locator(".jp-Notebook .widget-vbox").last
    explorer.scroll_into_view_if_needed()
    before = explorer.inner_text()
    page.screenshot(path=str(LAB_ARTIFACTS / f"{chapter}-explorer-before.png"))
    dropdowns = explorer.locator(".widget-dropdown select")
    if dropdowns.count():
        select = dropdowns.first
        options = select.locator("option").all_inner_texts()
        current = select.evaluate("s => s.options[s.selectedIndex].text")
        select.select_option(label=next(o for o in options if o != current))
    else:  # a slider: down a few steps, or up where the chapter left it at its minimum
        handle = explorer.locator(".noUi-handle").first
        handle.focus()
        at_min = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemin")
        for _ in range(10):
            page.keyboard.press("ArrowRight" if at_min else "ArrowLeft")
    page.wait_for_function("([e, b]) => e.innerText !== b", arg=[explorer.element_handle(), before], timeout=60_000)
    page.screenshot(path=str(LAB_ARTIFACTS / f"{chapter}-explorer-after.png"))

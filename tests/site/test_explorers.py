"""Every chapter's explorer answers on the built site, with no kernel: in a real chromium, each of its
controls is moved and the readout must change (scripts/site_explorers.py, docs/javascripts/explorers.js).

An explorer is live in one of two ways: its arithmetic runs in the page (``model``), or its controls pick
among answers the chapter's own code gave at build time (``grid``), which the page says. A control counts as
working when some value of it changes what the explorer shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CHAPTERS

EXPLORER = ".minserve-explorer"
# JS: the explorer's readouts and status line, as the reader sees them (a redrawn chart changes its SVG).
_SHOWN = "e => [...e.querySelectorAll('.minserve-widget-readout, .minserve-explorer-status')].map(r => r.innerHTML)"
# JS: the values a control can take: a select's options, a checkbox's two states, a slider's steps (≤ 12).
_CHOICES = """el => {
  if (el.tagName === 'SELECT') return [...el.options].map((_, i) => i);
  if (el.type === 'checkbox') return [!el.checked];
  if (el.type === 'range') {
    const lo = +el.min, hi = +el.max, step = +el.step || 1, n = Math.round((hi - lo) / step);
    const stride = Math.max(1, Math.ceil(n / 12));
    return [...Array(Math.floor(n / stride) + 1).keys()].map(j => lo + j * stride * step);
  }
  return [String(Math.max(1, Math.round(+el.value * 2)))];  // a number box (the model explorers)
}"""
# JS: set a control to a value as a reader would, then tell the page.
_SET = """(el, v) => {
  if (el.tagName === 'SELECT') el.selectedIndex = v;
  else if (el.type === 'checkbox') el.checked = v;
  else el.value = v;
  el.dispatchEvent(new Event('input', {bubbles: true}));
  el.dispatchEvent(new Event('change', {bubbles: true}));
}"""
# JS: where the control is now, to put it back.
_GET = "el => el.tagName === 'SELECT' ? el.selectedIndex : el.type === 'checkbox' ? el.checked : el.value"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_control_of_the_explorer_changes_its_readout(page, site_url: str, chapter: str, artifacts_dir: Path):
    page.goto(f"{site_url}chapters/{chapter}/")
    explorers = page.locator(EXPLORER)
    assert explorers.count() >= 1, f"{chapter}: no live explorer on the page (only widgets drawn as they were left)"
    for e in range(explorers.count()):
        explorer = explorers.nth(e)
        page.wait_for_function("e => e.dataset.ready === 'true'", arg=explorer.element_handle(), timeout=30_000)
        name = explorer.get_attribute("data-explorer")
        controls = explorer.locator("[data-control]")
        assert controls.count() >= 1, f"{chapter}: {name} has no live control"
        each = [controls.nth(i) for i in range(controls.count())]
        dead = [control.get_attribute("data-control") for control in each if not _moves(explorer, control)]
        assert dead == [], f"{chapter}: moving {dead} of the {name} explorer changed nothing on the page"
        explorer.scroll_into_view_if_needed()
        explorer.screenshot(path=str(artifacts_dir / f"{chapter}-explorer-{name}.png"))
    note = page.locator(".minserve-widget-note").first.inner_text()
    assert "Built results" in note or "Live" in note, f"{chapter}: the explorer does not say how it answers"
    assert page.remote_requests == [] and page.js_errors == []


def _moves(explorer, control) -> bool:
    """Whether some value of ``control`` changes what the explorer shows; the control is put back after."""
    start, before = control.evaluate(_GET), explorer.evaluate(_SHOWN)
    try:
        for value in control.evaluate(_CHOICES):
            control.evaluate(_SET, value)
            for _ in range(10):  # a chart redraws within a frame or two
                if explorer.evaluate(_SHOWN) != before:
                    return True
                explorer.page.wait_for_timeout(30)
        return False
    finally:
        control.evaluate(_SET, start)


@pytest.mark.parametrize(
    "setting",
    [
        {"model": "Llama-3-70B", "context": "32768", "batch": "4", "weights": "fp8", "KV cache": "fp8",
         "GPU": "H200 141GB"},
        {"model": "Qwen3-0.6B", "context": "1000", "batch": "300", "weights": "float32", "KV cache": "bfloat16",
         "GPU": "L4 24GB"},
    ],
)  # fmt: skip
def test_the_kv_calculator_in_the_page_agrees_with_minserve(page, site_url: str, setting: dict[str, str]) -> None:
    """The page's arithmetic (explorers.js) against minserve's own, at settings the chapter never ran."""
    from minserve.lab.kv import kv_calculator_result, kv_summary_html

    explorer = _set_in_page(page, f"{site_url}chapters/04_kv_cache/", "kv-calculator", setting)
    python = kv_summary_html(
        kv_calculator_result(setting["model"], int(setting["context"]), int(setting["batch"]), setting["weights"],
                             setting["GPU"], setting["KV cache"])
    )  # fmt: skip
    _assert_shows(page, explorer, python)


def _set_in_page(page, url: str, name: str, setting: dict[str, str]):
    """Open ``url``, wait for its ``name`` explorer, and set its controls as a reader would; the explorer."""
    page.goto(url)
    explorer = page.locator(f'.minserve-explorer[data-explorer="{name}"]')
    page.wait_for_function("e => e.dataset.ready === 'true'", arg=explorer.element_handle(), timeout=30_000)
    for control_name, value in setting.items():
        control = explorer.locator(f'[data-control="{control_name}"]')
        if control.evaluate("e => e.tagName") == "SELECT":
            control.select_option(label=value)
        else:
            control.fill(value)
    return explorer


def _assert_shows(page, explorer, python_html: str) -> None:
    """The explorer's readout is ``python_html``, both through the browser's own HTML serialisation (so
    quoting cannot differ)."""
    want = page.evaluate("h => Object.assign(document.createElement('div'), {innerHTML: h}).innerHTML", python_html)
    assert explorer.locator(".minserve-widget-readout").inner_html() == want


@pytest.mark.parametrize(
    "setting",
    [
        {"model": "Qwen3-30B-A3B", "hardware": "H200", "batch": "64", "context": "4096"},  # experts touched
        {"model": "Mistral-7B", "hardware": "L4", "batch": "3", "context": "32768"},  # sliding window; no fit
        {"model": "Llama-3-70B", "hardware": "H200", "batch": "512", "context": "1000"},  # compute-bound
    ],
)
def test_the_roofline_in_the_page_agrees_with_minserve(page, site_url: str, setting: dict[str, str]) -> None:
    """The page's roofline (explorers.js) against minserve.capacity's, at settings the chapter never ran."""
    from minserve.lab.roofline_widget import explorer_summary_html, roofline_explorer_result

    explorer = _set_in_page(page, f"{site_url}chapters/03_prefill_vs_decode/", "roofline", setting)
    python = explorer_summary_html(
        roofline_explorer_result(setting["model"], setting["hardware"], int(setting["batch"]), int(setting["context"]))
    )
    _assert_shows(page, explorer, python)
    assert "computed in this page" in explorer.locator(".minserve-explorer-status").inner_text()

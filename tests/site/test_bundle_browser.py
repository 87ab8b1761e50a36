"""The load tester's evidence bundle opens in a real headless chromium, from a file, with no network: every
chart draws and nothing is fetched from anywhere."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from minserve import slo
from minserve.bench.arrivals import OpenLoop
from minserve.bench.benchmark import BenchmarkResult
from minserve.bench.client import RequestResult
from minserve.bench.metrics import Pricing, summarize
from minserve.bench.runner import RunResult

CHART_DIV = ".plotly-graph-div"
_DRAWN = "d => d.querySelector('svg.main-svg') !== null && (d._fullData || []).length > 0"


def _run(rate: float, seed: int) -> RunResult:
    """A plausible run with ok, cancelled and failed requests, made up rather than measured."""
    rng = random.Random(seed)
    results = []
    for index in range(40):
        intended = index / rate
        sent = intended + rng.uniform(0, 0.002)
        chunks = [sent + rng.uniform(0.02, 0.2)]
        for _ in range(rng.randint(1, 20)):
            chunks.append(chunks[-1] + rng.uniform(0.005, 0.05))
        status = rng.choice(["ok"] * 8 + ["cancelled", "failed"])
        result = RequestResult(index, intended, sent, chunks, chunks[-1] + 0.001, status, output_tokens=len(chunks))
        if status == "failed":
            result.error = "http_429"
        results.append(result)
    return RunResult(f"rate={rate:g}", OpenLoop(rate), results, max(r.end_s for r in results), client_cpu_s=0.1)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = [_run(rate, seed) for seed, rate in enumerate((2.0, 8.0, 32.0))]
    contract = slo.SLO("chat", ttft_s=0.15, tpot_s=0.05)
    summaries = [summarize(run, contract, Pricing(2.5)) for run in runs]
    out = BenchmarkResult(runs, summaries, {"options": {"base_url": "http://example.invalid"}}).save(
        tmp_path_factory.mktemp("bundle")
    )
    return out / "report.html"


def test_bundle_charts_draw_offline_from_a_file(browser_context, bundle: Path, artifacts_dir: Path) -> None:
    page = browser_context.new_page()
    fetched, errors = [], []

    def only_the_file(route) -> None:
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            fetched.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_file)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(bundle.as_uri())
    charts = page.locator(CHART_DIV).count()
    assert charts >= 4  # CDFs, distributions, the sweep curve, the timeline
    page.wait_for_function(f"[...document.querySelectorAll('{CHART_DIV}')].every({_DRAWN})", timeout=60_000)
    assert "FAIL" in page.inner_text("body") or "PASS" in page.inner_text("body")
    page.screenshot(path=str(artifacts_dir / "evidence-bundle.png"), full_page=True)
    assert fetched == [] and errors == []
    page.close()

"""minserve.lab.kv_figures and kv_experiments: KV tables against published numbers, fragmentation bounds, the
engine sampler, the figures."""

from __future__ import annotations

import random

import pandas as pd
import pytest

from minserve import LLM, SamplingParams
from minserve.lab import kv_experiments, kv_figures

PUBLISHED = {
    "Llama-2-7B": 524_288,
    "Llama-2-13B": 819_200,
    "Llama-3-8B": 131_072,
    "Mistral-7B": 131_072,
    "Llama-3-70B": 327_680,
}


def test_kv_per_token_table_matches_published_figures():
    table = kv_figures.kv_per_token_table(PUBLISHED)
    assert (table["bytes/token"] == table["published"]).all()
    assert table.loc["Llama-3-8B", "KV heads"] == 8
    assert table.loc["Llama-2-7B", "GB per 4096-token request"] == pytest.approx(524_288 * 4096 / 1e9)


def test_context_concurrency_grid_is_a_product():
    grid = kv_figures.context_concurrency_grid_gb("Llama-3-8B", [1024, 2048], [1, 4])
    assert grid.loc[1, 1024] == pytest.approx(131_072 * 1024 / 1e9)
    assert grid.loc[4, 2048] == pytest.approx(8 * grid.loc[1, 1024])
    fig = kv_figures.context_concurrency_heatmap("Llama-3-8B", [1024, 131072], [1, 128], budget_gb=64)
    assert "✗" in fig.data[0].text[1][1] and "✗" not in fig.data[0].text[0][0]


@pytest.mark.parametrize("seed", range(10))
def test_fragmentation_is_below_one_block_per_sequence(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 5000) for _ in range(rng.randint(1, 30))]
    table = kv_figures.fragmentation_table(lens, [1, 4, 16, 64, 256])
    assert (table["max wasted/seq"] < table.index).all()
    assert table.loc[1, "wasted share"] == 0
    assert table["mean wasted/seq"].is_monotonic_increasing or len(set(lens)) == 1


def test_fragmentation_of_exact_multiples_is_zero():
    table = kv_figures.fragmentation_table([16, 32, 48], [16])
    assert table.loc[16, "max wasted/seq"] == 0


@pytest.fixture(scope="module")
def tight_llm():
    return LLM(num_kv_blocks=8, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=False)


def test_sample_kv_usage_under_pressure(tight_llm):
    usage, outputs = kv_experiments.sample_kv_usage(
        tight_llm, [f"def f{i}(x):" for i in range(6)], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    assert len(outputs) == 6 and all(len(o.token_ids) == 20 for o in outputs)
    assert usage["used_blocks"].max() <= 8
    assert (usage["used_blocks"] * 16 >= usage["stored_tokens"]).all()
    assert usage["finished"].is_monotonic_increasing and usage["finished"].iloc[-1] == 6
    assert tight_llm.stats()["kv_blocks_used"] == 0
    for fig in (
        kv_figures.admission_figure(usage, num_blocks=8),
        kv_figures.reserved_vs_used_figure(usage, block_size=16, max_model_len=512),
    ):
        assert all(len(trace.x) == len(usage) for trace in fig.data)


def test_prefix_cache_figure_labels_hit_rates():
    fig = kv_figures.prefix_cache_figure({"on": [1.0, 0.5], "off": [1.0, 1.0]}, {"on": 0.5, "off": 0.0})
    assert [t.name for t in fig.data] == ["on (hit rate 50%)", "off (hit rate 0%)"]


def test_figures_draw_the_predictions_beside_the_measurements(tight_llm):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    usage, _ = kv_experiments.sample_kv_usage(tight_llm, ["def g(x):"] * 2, params)
    predicted = usage["used_blocks"] + 0
    paged = kv_figures.reserved_vs_used_figure(usage, 16, 512, predicted_blocks=predicted)
    (drawn,) = [trace for trace in paged.data if trace.name.startswith("predicted")]
    assert list(drawn.y) == list(predicted * 16)
    admission = kv_figures.admission_figure(usage, num_blocks=8, predicted_admitted=2)
    assert admission.data[0].y == (2,)
    sweep = pd.DataFrame({"filler_blocks": [0, 8, 16], "cached_tokens": [32, 16, 0], "hit_rate": [0.8, 0.4, 0.0]})
    eviction = kv_figures.eviction_figure(sweep, [32, 16, 0], pool_blocks=16, prompt_tokens=40)
    assert list(eviction.data[0].y) == [0.8, 0.4, 0.0] and list(eviction.data[1].y) == [0.8, 0.4, 0.0]
    assert eviction.layout.shapes[0].x0 == 16
    title = kv_figures.prefix_cache_figure({"on": [1.0]}, {"on": 0.5}, predicted_hit_rate=0.5).layout.title.text
    assert "predicted hit rate 50%" in title

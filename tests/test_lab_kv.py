"""minserve.lab.kv: the KV calculator's callback, its readout, the widget wiring and the KV-vs-context figure."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve import capacity, lab
from minserve.lab import kv
from minserve.model.loader import ASSETS_DIR

TINY_HF = json.loads((ASSETS_DIR / "minserve-tiny" / "config.json").read_text())


def test_calculator_result_for_a_preset():
    result = lab.kv_calculator_result("Llama-2-7B", context_tokens=4096, batch=4, dtype="float16", gpu="A100 80GB")
    assert result["kv_bytes_per_token"] == 524_288
    assert result["kv_bytes_per_request"] == 4096 * 524_288  # 4096 is a whole number of 16-token blocks
    assert result["kv_bytes"] == 4 * 4096 * 524_288
    assert result["gpu_bytes"] == 80 * 10**9
    assert result["fits"] and result["headroom_bytes"] > 0
    # 2.15 GB of KV per sequence beside 13.5 GB of weights in 72 GB usable: (72 − 13.5) / 2.15 → 27, not 28.
    assert result["max_sequences"] == 27
    assert lab.kv_calculator_result("Llama-2-7B", 4096, 27, "float16", "A100 80GB")["fits"]
    assert not lab.kv_calculator_result("Llama-2-7B", 4096, 28, "float16", "A100 80GB")["fits"]


def test_calculator_result_for_any_hf_config():
    result = lab.kv_calculator_result(TINY_HF, context_tokens=2048, batch=1, gpu="L4 24GB")
    assert result["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 2  # layers, KV heads, head_dim from config.json
    assert result["fits"]


@settings(max_examples=40)
@given(
    st.sampled_from(sorted(capacity.MODEL_PRESETS)),
    st.integers(1, 131_072),
    st.integers(1, 256),
    st.sampled_from(kv.DTYPES),
    st.sampled_from(sorted(capacity.GPU_MEMORY_BYTES)),
)
def test_calculator_invariants(model, context, batch, dtype, gpu):
    result = lab.kv_calculator_result(model, context, batch, dtype, gpu)
    assert result["kv_bytes"] == batch * result["kv_bytes_per_request"]
    assert result["kv_bytes_per_request"] >= context * result["kv_bytes_per_token"]
    assert result["fits"] == (result["headroom_bytes"] >= 0) == (batch <= result["max_sequences"])
    longer = lab.kv_calculator_result(model, context + 1024, batch, dtype, gpu)
    assert longer["headroom_bytes"] < result["headroom_bytes"]  # more context never frees memory


def test_resolve_model_prefers_a_paste_then_extra_models_then_presets():
    assert kv.resolve_model("Llama-3-8B") == "Llama-3-8B"
    assert kv.resolve_model("tiny", "", {"tiny": TINY_HF}) is TINY_HF
    assert kv.resolve_model("Llama-3-8B", json.dumps(TINY_HF)) == TINY_HF
    with pytest.raises(ValueError, match="not JSON"):
        kv.resolve_model("Llama-3-8B", "{not json")
    with pytest.raises(ValueError, match="JSON object"):
        kv.resolve_model("Llama-3-8B", "[1, 2]")


def test_format_bytes():
    assert [kv.format_bytes(n) for n in (0, 999, 131_072, 8.6e9, -2.5e9, 3e12)] == [
        "0 B",
        "999 B",
        "131.1 kB",
        "8.6 GB",
        "−2.5 GB",
        "3.0 TB",
    ]


def test_summary_html_says_whether_it_fits():
    fits = kv.kv_summary_html(lab.kv_calculator_result("Llama-3-8B", 8192, 8))
    assert "131,072 B" in fits and ">fits<" in fits
    too_big = kv.kv_summary_html(lab.kv_calculator_result("Llama-3-70B", 8192, 8))
    assert "does not fit" in too_big and "−" in too_big  # negative headroom


def test_widget_updates_through_the_callback():
    box = lab.kv_calculator(models={"tiny": TINY_HF}, model="Llama-3-8B", context_tokens=8192, batch=8)
    choice, pasted, context, batch, _dtype, _kv_dtype, gpu, readout = box.children
    assert "131,072 B" in readout.value and ">fits<" in readout.value
    choice.value = "Llama-3-70B"
    assert "does not fit" in readout.value
    gpu.value = "B200 180GB"
    assert readout.value == kv.kv_summary_html(lab.kv_calculator_result("Llama-3-70B", 8192, 8, gpu="B200 180GB"))
    pasted.value = "{broken"
    assert "not JSON" in readout.value
    pasted.value = json.dumps(TINY_HF)
    assert f"{2 * 4 * 2 * 64 * 2:,} B" in readout.value
    assert "tiny" in choice.options and context.value == 8192 and batch.value == 8


def test_memory_figure_lines_and_gpu_lines():
    contexts = [0, 1024, 4096]
    fig = lab.kv_memory_figure(["Llama-2-7B", "Llama-3-8B"], contexts, concurrency=2, gpus=["H100 80GB", "L4 24GB"])
    assert [trace.name for trace in fig.data] == ["Llama-2-7B", "Llama-3-8B"]
    assert list(fig.data[0].y) == pytest.approx([0.0, 2 * 1024 * 524_288 / 1e9, 2 * 4096 * 524_288 / 1e9])
    assert list(fig.data[1].y) == pytest.approx([y / 4 for y in fig.data[0].y])  # GQA: a quarter
    assert sorted(shape.y0 for shape in fig.layout.shapes) == pytest.approx([24.0, 80.0])
    custom = lab.kv_memory_figure({"tiny": TINY_HF}, contexts, gpus=[])
    assert custom.data[0].name == "tiny" and not custom.layout.shapes

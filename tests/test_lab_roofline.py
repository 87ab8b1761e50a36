"""Chapter 03's tables, figures and roofline explorer (``minserve.lab.roofline_*``, ``gpu_figures``) and the
decode-cost fit (:mod:`minserve.capacity.decode_fit`), on hand-made profiles and presets.

The profile tests build :class:`~minserve.capacity.profiler.Profile` objects by hand on a toy accelerator
whose "measured" times are known multiples of the roofline's bound, so every number the tables derive is
known exactly; one test profiles the real engine on a tiny sweep, and checks shapes only (never a speed).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve import LLM, capacity, lab
from minserve.capacity import decode_fit, profiler
from minserve.capacity.profiler import DecodePoint, PrefillPoint, Profile
from minserve.capacity.roofline import HARDWARE, Hardware
from minserve.lab import gpu_figures, roofline_figures, roofline_tables, roofline_widget

# 1 TFLOP/s and 10 GB/s: the ridge point is at 100 FLOP/byte.
TOY = Hardware("toy", peak_flops_per_s=1e12, memory_bandwidth_bytes_per_s=1e10, memory_bytes=10**12, dtype="float32")
SMALL = capacity.model_config("Qwen3-0.6B")  # a real model shape; only its arithmetic is used


def _profile(slowdown=3.0, fixed_s=0.0, per_sequence_s=0.0, batches=(1, 2, 4, 8), contexts=(64, 512)):
    """A profile whose measured times are ``slowdown ×`` the bound (+ an optional fixed and per-sequence cost)."""
    prefill = []
    for tokens in (16, 128, 1024):
        pred = capacity.predict_prefill(SMALL, tokens, TOY, "float32")
        prefill.append(PrefillPoint(tokens, slowdown * pred.time_s, (slowdown * pred.time_s,), pred))
    decode = []
    for context in contexts:
        for batch in batches:
            pred = capacity.predict_decode(SMALL, batch, context, TOY, "float32")
            step = slowdown * pred.time_s if not (fixed_s or per_sequence_s) else fixed_s + per_sequence_s * batch
            decode.append(DecodePoint(batch, context, context, step, (step,), step * 0.9, pred))
    return Profile("toy-model", "cpu", "float32", TOY, tuple(prefill), tuple(decode), wall_s=1.0)


# --- the engine, measured -----------------------------------------------------------------------------------


def test_profile_table_derives_bound_ratio_and_achieved_flops():
    profile = _profile(slowdown=3.0)
    table = roofline_tables.profile_table(profile)
    assert len(table) == 3 + 8
    assert list(table.columns[:5]) == ["phase", "tokens", "batch", "context", "measured ms"]
    assert table["× bound"].to_list() == pytest.approx([3.0] * len(table))
    # Three times slower than the bound: a third of the roof's FLOP/s, wherever the point sits.
    assert (table["achieved GFLOP/s"] * 3).to_list() == pytest.approx(table["roof GFLOP/s"].to_list())
    prefill = table[table.phase == "prefill"]
    assert prefill["forward ms"].isna().all() and (prefill["tokens/s"] > 0).all()
    decode = table[table.phase == "decode"]
    assert decode["tokens"].eq(1).all()
    assert decode["tokens/s"].to_list() == pytest.approx((decode["batch"] / decode["measured ms"] * 1e3).to_list())
    # The toy ridge is 100 FLOP/byte: decode at batch 1 is below it, a 1024-token float32 prefill above.
    assert decode.iloc[0]["roof"] == "memory" and prefill.iloc[-1]["roof"] == "compute"


def test_decode_cost_fit_recovers_a_line_and_ignores_an_outlier():
    profile = _profile(fixed_s=2e-3, per_sequence_s=1e-4, batches=(1, 2, 4, 8, 16))
    fit = decode_fit.decode_cost_fit(profile)
    assert fit == pytest.approx({"context_tokens": 64.0, "fixed_s": 2e-3, "per_sequence_s": 1e-4})
    # One step slowed down 30× by another process moves a least-squares line far; the median fit stays put.
    points = list(profile.decode)
    points[3] = DecodePoint(8, 64, 64, 30 * points[3].step_s, (), None, points[3].predicted)
    noisy = Profile(**{**vars(profile), "decode": tuple(points)})
    assert decode_fit.decode_cost_fit(noisy) == pytest.approx(fit)
    assert decode_fit.decode_cost_fit(profile, 512)["context_tokens"] == 512
    with pytest.raises(ValueError, match="two or more batch sizes"):
        decode_fit.decode_cost_fit(_profile(batches=(4,)))
    with pytest.raises(ValueError, match="no decode points"):
        decode_fit.decode_cost_fit(Profile(**{**vars(profile), "decode": ()}))


def test_roofline_figure_places_points_under_the_roof():
    profile = _profile(slowdown=4.0)
    fig = roofline_figures.roofline_figure(profile)
    names = [trace.name for trace in fig.data]
    assert names[:3] == ["roof (measured probes)", "ridge point: 100 FLOP/byte", "roofline bound"]
    assert names[3] == "prefill (prompt tokens)" and len(names) == 4 + 2  # one decode trace per context
    roof_trace = fig.data[0]
    assert list(roof_trace.x)[1] == pytest.approx(100) and list(roof_trace.y)[1] == pytest.approx(1e12)
    bounds, prefill = fig.data[2], fig.data[3]
    assert list(prefill.y) == pytest.approx([p.predicted.flops / p.time_s for p in profile.prefill])
    assert list(prefill.y) == pytest.approx([y / 4 for y in list(bounds.y)[:3]])
    # The axes are log and fixed to a range that holds every point (plotly wants log10 of the limits).
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"
    x_low, x_high = (10**v for v in fig.layout.xaxis.range)
    y_low, y_high = (10**v for v in fig.layout.yaxis.range)
    for trace in fig.data[3:]:
        assert all(x_low < x < x_high for x in trace.x) and all(y_low < y < y_high for y in trace.y)


def test_measured_vs_predicted_figure_pairs_every_line_with_its_bound():
    profile = _profile()
    fig = roofline_figures.measured_vs_predicted_figure(profile)
    assert len(fig.data) == 2 + 2 * 2
    measured, bound = fig.data[0], fig.data[1]
    assert list(measured.x) == [16, 128, 1024]
    assert list(measured.y) == pytest.approx([3 * y for y in bound.y])
    assert all(axis.type == "log" for axis in (fig.layout.xaxis, fig.layout.xaxis2, fig.layout.yaxis))


def test_profile_of_the_real_engine_fits_the_tables():
    llm = LLM(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    profile = profiler.profile(
        llm, TOY, prompt_lengths=(8, 32), batch_sizes=(1, 4), context_lengths=(16,), repeats=1, decode_steps=2
    )
    table = roofline_tables.profile_table(profile)
    assert len(table) == 4 and (table["measured ms"] > 0).all() and (table["bound ms"] > 0).all()
    assert table["measured ms"].map(math.isfinite).all()
    fit = decode_fit.decode_cost_fit(profile)
    assert set(fit) == {"context_tokens", "fixed_s", "per_sequence_s"}
    assert len(roofline_figures.roofline_figure(profile).data) == 5


# --- GPUs, predicted ----------------------------------------------------------------------------------------


def test_attention_intensity_table():
    table = roofline_tables.attention_intensity_table([(1, 4096), (4096, 4096)])
    assert table["S·T/(S+T)"].to_list() == pytest.approx([4096 / 4097, 2048])
    assert table["MHA (bfloat16)"].to_list() == pytest.approx(table["S·T/(S+T)"].to_list())
    assert table.loc[0, "GQA g=4 (bfloat16)"] == pytest.approx(4 * 4096 / (4096 + 4))


def test_gpu_predictions_table_for_llama_3_8b():
    table = roofline_tables.gpu_predictions_table("Llama-3-8B", prompt_tokens=2048, batch=64, context_tokens=2048)
    assert list(table.index) == [hw.name for hw in HARDWARE.values()]
    assert round(table.loc["H100 SXM", "critical batch"]) == 295
    assert round(table.loc["H200 SXM", "critical batch"]) == 206
    assert (table["decode B=1 roof"] == "memory").all() and (table["prefill roof"] == "compute").all()
    assert (table["decode B=64 ms"] > table["decode B=1 ms"]).all()
    # 16 GB of weights and 17 GB of KV: fits in 80 GB, not in an L4's 24 GB.
    assert table.loc["H100 SXM", "B=64 fits"] and not table.loc["L4", "B=64 fits"]
    h100 = capacity.predict_decode("Llama-3-8B", 64, 2048, HARDWARE["H100"])
    assert table.loc["H100 SXM", "tokens/s at B=64"] == pytest.approx(64 / h100.time_s)


def test_gpu_rooflines_figure_draws_each_roof_and_each_phase():
    fig = gpu_figures.gpu_rooflines_figure("Llama-3-8B", gpus=("H100", "L4"), prompt_tokens=2048, batches=(1, 64))
    assert [t.name for t in fig.data[:2]] == ["H100 SXM", "L4"]
    phases = fig.data[2:]
    assert len(phases) == 3 and phases[0].name.startswith("prefill 2048: 1,943 FLOP/byte")
    decode_1 = capacity.predict_decode("Llama-3-8B", 1, 2048, HARDWARE["H100"])
    assert list(phases[1].x) == pytest.approx([decode_1.intensity_flops_per_byte] * 2)


def test_decode_sweep_invariants():
    sweep = roofline_tables.decode_sweep("Llama-3-8B", "H100", [1, 8, 64, 512, 4096], [128, 8192])
    assert sweep["tokens/s"].to_list() == pytest.approx((sweep["batch"] / sweep["step_s"]).to_list())
    for _, rows in sweep.groupby("context"):
        assert rows["step_s"].is_monotonic_increasing
        assert rows["fits"].is_monotonic_decreasing  # once it does not fit, a bigger batch does not either
    short = sweep[sweep.context == 128].set_index("batch")
    assert short.loc[1, "roof"] == "memory" and short.loc[4096, "roof"] == "compute"


def test_critical_batch_figure_marks_the_critical_batch_and_what_does_not_fit():
    fig = gpu_figures.critical_batch_figure(
        "Llama-3-8B", "H100", batches=[1, 16, 256, 4096], contexts_tokens=[128, 16384]
    )
    critical = next(t for t in fig.data if t.name.startswith("critical batch"))
    assert list(critical.x) == pytest.approx([989e12 / 3.35e12] * 2)
    dotted = [t for t in fig.data if t.line.dash == "dot"]
    assert dotted and all(t.showlegend is False for t in dotted)


# --- the explorer -------------------------------------------------------------------------------------------


def test_explorer_result_for_llama_3_8b_on_an_h100():
    result = lab.roofline_explorer_result("Llama-3-8B", "H100", batch=1, context_tokens=2048)
    assert result["hardware"] == "H100 SXM" and result["dtype"] == "bfloat16"
    assert result["decode_bound"] == "memory" and result["prefill_bound"] == "compute"
    assert result["decode_step_s"] == pytest.approx(
        capacity.decode_step_time_s("Llama-3-8B", 1, 2048, HARDWARE["H100"])
    )
    assert round(result["critical_batch"]) == 295 and result["fits"]
    assert lab.roofline_explorer_result("Llama-3-8B", "H100", 4096, 128)["decode_bound"] == "compute"
    assert not lab.roofline_explorer_result("Llama-3-70B", "L4", 1, 2048)["fits"]
    with pytest.raises(ValueError):
        lab.roofline_explorer_result("Llama-3-8B", "H100", 0, 2048)
    with pytest.raises(ValueError, match="unknown GPU"):
        lab.roofline_explorer_result("Llama-3-8B", "TPU", 1, 2048)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(capacity.MODEL_PRESETS)),
    st.sampled_from(sorted(HARDWARE)),
    st.integers(1, 4096),
    st.integers(1, 131_072),
)
def test_explorer_invariants(model, gpu, batch, context):
    result = lab.roofline_explorer_result(model, gpu, batch, context)
    assert result["decode_step_s"] == max(result["decode_compute_s"], result["decode_memory_s"])
    assert result["tokens_per_s"] == pytest.approx(batch / result["decode_step_s"])
    assert result["tokens_per_s_per_sequence"] == pytest.approx(1 / result["decode_step_s"])
    assert result["decode_bound"] == (
        "compute" if result["decode_compute_s"] >= result["decode_memory_s"] else "memory"
    )
    assert result["fits"] == (result["memory_needed_bytes"] <= result["memory_bytes"])
    assert result["prefill_tokens"] == context


def test_explorer_extra_hardware_and_models():
    result = lab.roofline_explorer_result(SMALL, "this machine", 4, 64, hardware={"this machine": TOY})
    assert result["hardware"] == "toy" and result["dtype"] == "float32" and result["ridge"] == 100


def test_summary_html_and_durations():
    fits = lab.roofline_explorer_result("Llama-3-8B", "H100", 1, 2048)
    assert "memory-bound on H100 SXM" in roofline_widget.explorer_summary_html(fits)
    assert "do not fit" not in roofline_widget.explorer_summary_html(fits)
    assert "do not fit" in roofline_widget.explorer_summary_html(
        lab.roofline_explorer_result("Llama-3-70B", "L4", 1, 2048)
    )
    assert roofline_widget.format_seconds(0.0042) == "4.20 ms"
    assert roofline_widget.format_seconds(2.5) == "2.5 s"
    assert roofline_widget.format_seconds(16e-6) == "16.00 µs"
    assert roofline_widget.format_seconds(3e-9) == "3.0 ns"


def test_widget_updates_through_the_callback():
    box = lab.roofline_explorer(models={"tiny": SMALL}, hardware={"this machine": TOY})
    choice, gpu, batch, context, readout = box.children
    assert "tiny" in choice.options and "this machine" in gpu.options
    assert readout.value == roofline_widget.explorer_summary_html(
        lab.roofline_explorer_result("Llama-3-8B", "H100", 1, 2048)
    )
    batch.value = 4096
    context.value = 128
    assert "compute-bound" in readout.value
    gpu.value = "this machine"
    choice.value = "tiny"
    assert readout.value == roofline_widget.explorer_summary_html(lab.roofline_explorer_result(SMALL, TOY, 4096, 128))


def test_causal_prefill_attention_reaches_about_a_quarter_of_the_context():
    """Causal masking: a prefill computes S(S+1)/2 of the S² query-key pairs, so about S/4 FLOP/byte in bf16."""
    row = roofline_tables.attention_intensity_table([(4096, 4096)]).iloc[0]
    assert row["MHA (bfloat16)"] == pytest.approx(2048)
    assert row["MHA causal (bfloat16)"] == pytest.approx(4096 / 4, rel=1e-3)


def test_last_level_cache_reads_the_highest_level(tmp_path):
    from minserve.lab.roofline_weights import last_level_cache_bytes

    for name, level, size in (("index0", 1, "48K"), ("index2", 2, "2048K"), ("index3", 3, "260M")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(str(tmp_path)) == 260 * 2**20
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None


def test_read_bandwidth_probe_is_positive_and_refuses_nonsense():
    from minserve.capacity.roofline import measure_read_bandwidth

    assert measure_read_bandwidth(read_mib=4, repeats=2) > 0
    with pytest.raises(ValueError):
        measure_read_bandwidth(read_mib=0)

"""minserve.capacity.roofline, .profiler and `minserve plan roofline`: published facts, hand-worked arithmetic,
properties, the probe, the profiler on the embedded model, and the command line.

No test asserts a wall-clock threshold: measured times are checked for shape and for orderings that hold by
construction or by a wide margin.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve import capacity
from minserve.capacity import roofline
from minserve.capacity.roofline import HARDWARE, Hardware
from minserve.cli import main

H100, H200 = HARDWARE["H100"], HARDWARE["H200"]
LLAMA_3_8B = capacity.model_config("Llama-3-8B")
# A made-up accelerator whose numbers are easy to work by hand: 100 FLOP/s, 10 bytes/s, ridge at 10 FLOP/byte.
TOY = Hardware("toy", peak_flops_per_s=100.0, memory_bandwidth_bytes_per_s=10.0, memory_bytes=1000)


# --- the hardware table against published facts -------------------------------------------------------------


def test_critical_batch_sizes_are_the_published_ones():
    # The curriculum's facts: H100 bf16 dense 989e12 / 3.35e12 ≈ 295, H200 989e12 / 4.8e12 ≈ 206.
    assert round(capacity.critical_batch_size(H100)) == 295
    assert round(capacity.critical_batch_size(H200)) == 206
    assert H100.ridge_point_flops_per_byte == pytest.approx(295.2, abs=0.1)
    assert round(capacity.critical_batch_size(HARDWARE["A100"])) == 153  # 312e12 / 2.039e12


def test_table_holds_dense_bf16_numbers():
    expected = {  # name: (dense bf16 FLOP/s, bytes/s, memory bytes)
        "H100": (989e12, 3.35e12, 80e9),
        "H200": (989e12, 4.8e12, 141e9),
        "A100": (312e12, 2.039e12, 80e9),
        "L4": (121e12, 300e9, 24e9),
        "B200": (2.25e15, 8e12, 180e9),
        "MI300X": (1307e12, 5.3e12, 192e9),
    }
    assert set(HARDWARE) == set(expected)
    for key, (flops, bandwidth, memory) in expected.items():
        hw = HARDWARE[key]
        assert (hw.peak_flops_per_s, hw.memory_bandwidth_bytes_per_s, hw.memory_bytes) == (flops, bandwidth, memory)
        assert hw.dtype == "bfloat16" and hw.source


def test_memory_sizes_agree_with_the_presets():
    pairs = {"H100": "H100 80GB", "H200": "H200 141GB", "A100": "A100 80GB", "L4": "L4 24GB", "B200": "B200 180GB",
             "MI300X": "MI300X 192GB"}  # fmt: skip
    for key, preset in pairs.items():
        assert HARDWARE[key].memory_bytes == capacity.gpu_memory_bytes(preset)


def test_hardware_lookup(monkeypatch):
    assert capacity.hardware("h100") is H100 and capacity.hardware("H200 SXM") is H200
    with pytest.raises(ValueError, match="H100.*MI300X.*this"):
        capacity.hardware("TPU v5")
    measured = Hardware("this machine (stub)", 1e11, 1e10, 2**30, dtype="float32")
    monkeypatch.setattr(roofline, "measure_this_machine", lambda: measured)
    assert capacity.hardware(" This ") is measured


# --- the roofline, worked by hand ---------------------------------------------------------------------------


def test_roofline_arithmetic_by_hand():
    assert capacity.arithmetic_intensity(100, 50) == 2
    assert capacity.ridge_point_flops_per_byte(TOY) == 10
    assert capacity.attainable_flops_per_s(TOY, 5) == 50  # slanted roof: 5 FLOP/byte × 10 bytes/s
    assert capacity.attainable_flops_per_s(TOY, 20) == 100  # flat roof: the peak
    # Critical batch: 2 FLOPs per weight per sequence, so B = ridge × bytes per weight / 2.
    assert [capacity.critical_batch_size(TOY, d) for d in ("bfloat16", "float32", "fp8")] == [10, 20, 5]
    work = roofline.predict(flops=1000, bytes_moved=50, hw=TOY)
    assert (work.compute_s, work.memory_s, work.time_s, work.bound) == (10, 5, 10, "compute")
    assert work.intensity_flops_per_byte == 20
    assert roofline.predict(100, 50, TOY).bound == "memory"
    with pytest.raises(ValueError):
        capacity.arithmetic_intensity(1, 0)


def test_attended_keys_by_hand():
    assert roofline.attended_keys(4, 4) == 1 + 2 + 3 + 4  # causal prefill: T(T + 1)/2
    assert roofline.attended_keys(1, 1000) == 1000  # decode: every key, its own included
    assert roofline.attended_keys(2, 10) == 9 + 10  # a chunk of 2 after 8 cached tokens
    assert roofline.attended_keys(1, 1000, sliding_window_tokens=256) == 256
    assert roofline.attended_keys(4, 10, sliding_window_tokens=3) == 4 * 3
    assert roofline.attended_keys(0, 10) == 0
    with pytest.raises(ValueError):
        roofline.attended_keys(5, 4)


def test_attention_intensity_by_hand():
    # 16-bit multi-head attention: S·T/(S+T). Prefill (T = S) is S/2; decode (T = 1) stays below 1.
    assert capacity.attention_intensity_flops_per_byte(1024, 1024) == 512
    assert capacity.attention_intensity_flops_per_byte(1, 4096) == pytest.approx(4096 / 4097)
    assert capacity.attention_intensity_flops_per_byte(1, 4096, "float32") == pytest.approx(4096 / 4097 / 2)
    # Grouped-query attention: g query heads share one K/V read, so decode's intensity approaches g.
    assert capacity.attention_intensity_flops_per_byte(1, 10**6, queries_per_kv=4) == pytest.approx(4, rel=1e-4)


def test_llama_3_8b_flops_and_bytes_by_hand():
    # Per layer: attention 4096·(4096 + 2·1024) + 4096·4096 = 41,943,040; MLP 3·4096·14336 = 176,160,768.
    # Multiplied weights: 32 layers of those + the LM head 128256·4096 = 7,504,658,432.
    multiplied = 32 * (41_943_040 + 176_160_768) + 128_256 * 4096
    assert multiplied == 7_504_658_432
    assert capacity.flops_per_token(LLAMA_3_8B) == 2 * multiplied
    assert capacity.weights_read_bytes(LLAMA_3_8B, "bfloat16") == 2 * multiplied
    # Decode at batch 1, context 1024: weights once + 1024 tokens × 131,072 KV bytes.
    assert capacity.decode_bytes(LLAMA_3_8B, 1, 1024) == 2 * multiplied + 1024 * 131_072
    attention = 4 * 32 * 128 * 1024 * 32  # 4 × heads × head_dim × keys × layers
    assert capacity.decode_flops(LLAMA_3_8B, 1, 1024) == 2 * multiplied + attention
    # Prefill: every token through the layers, the LM head once (only the last token is sampled).
    layers = 2 * 32 * (41_943_040 + 176_160_768)
    assert capacity.prefill_flops(LLAMA_3_8B, 2) == 2 * layers + 2 * 128_256 * 4096 + 4 * 32 * 128 * 3 * 32


def test_flops_per_token_is_about_twice_the_parameters():
    # Within 7% for Llama-3-8B: its untied embedding (0.53e9 of its 8.03e9 parameters) is looked up, not
    # multiplied, and the norms are not matmuls. The gap is exactly those.
    params = capacity.estimate_params(LLAMA_3_8B)
    assert capacity.flops_per_token(LLAMA_3_8B) == pytest.approx(2 * params, rel=0.07)
    c = LLAMA_3_8B
    not_multiplied = c.vocab_size * c.hidden_size + (2 * c.num_layers + 1) * c.hidden_size  # embedding, norms
    assert 2 * params - capacity.flops_per_token(c) == 2 * not_multiplied


def test_h100_decode_is_memory_bound_and_long_prefill_compute_bound():
    decode = capacity.predict_decode(LLAMA_3_8B, batch=1, context_tokens=1024, hw=H100)
    assert decode.bound == "memory" and decode.intensity_flops_per_byte < 2
    assert decode.time_s == pytest.approx((15_009_316_864 + 1024 * 131_072) / 3.35e12)  # ≈ 4.5 ms
    for prompt in (512, 2048, 8192):
        assert capacity.predict_prefill(LLAMA_3_8B, prompt, H100).bound == "compute"
    assert capacity.prefill_time_s(LLAMA_3_8B, 2048, H100) == pytest.approx(
        capacity.prefill_flops(LLAMA_3_8B, 2048) / 989e12
    )


def test_the_critical_batch_size_separates_the_regimes():
    # With almost no KV to read (context 1), decode turns compute-bound near batch 295 on an H100 ...
    assert capacity.predict_decode(LLAMA_3_8B, 250, 1, H100).bound == "memory"
    assert capacity.predict_decode(LLAMA_3_8B, 350, 1, H100).bound == "compute"
    # ... but every sequence reads its own KV cache, so at a 4k context it never does.
    assert capacity.predict_decode(LLAMA_3_8B, 4096, 4096, H100).bound == "memory"


# --- properties ---------------------------------------------------------------------------------------------

presets = st.sampled_from(sorted(capacity.MODEL_PRESETS))
gpus = st.sampled_from(sorted(HARDWARE))
batches = st.integers(1, 1024)
contexts = st.integers(1, 32_768)


@settings(max_examples=60)
@given(presets, gpus, batches, contexts, st.integers(1, 1024), st.integers(1, 8192))
def test_decode_time_grows_with_batch_and_context_but_not_per_token(name, gpu, batch, context, more_b, more_c):
    config, hw = capacity.model_config(name), HARDWARE[gpu]
    t = capacity.decode_step_time_s(config, batch, context, hw)
    assert t <= capacity.decode_step_time_s(config, batch + more_b, context, hw)
    assert t <= capacity.decode_step_time_s(config, batch, context + more_c, hw)
    # Batching shares the weights: time per token never rises with the batch.
    bigger = capacity.decode_step_time_s(config, batch + more_b, context, hw)
    assert bigger / (batch + more_b) <= t / batch * (1 + 1e-12)


@settings(max_examples=60)
@given(presets, gpus, st.integers(1, 32_768), st.integers(1, 8192))
def test_prefill_time_grows_with_the_prompt(name, gpu, prompt, more):
    config, hw = capacity.model_config(name), HARDWARE[gpu]
    assert capacity.prefill_time_s(config, prompt, hw) <= capacity.prefill_time_s(config, prompt + more, hw)
    assert capacity.prefill_flops(config, prompt, batch=3) == 3 * capacity.prefill_flops(config, prompt)


@given(gpus, st.floats(1e-3, 1e6))
def test_attainable_is_under_both_roofs(gpu, intensity):
    hw = HARDWARE[gpu]
    attainable = capacity.attainable_flops_per_s(hw, intensity)
    assert attainable <= hw.peak_flops_per_s and attainable <= intensity * hw.memory_bandwidth_bytes_per_s
    assert attainable in (hw.peak_flops_per_s, intensity * hw.memory_bandwidth_bytes_per_s)


@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_attention_intensity_is_symmetric_and_below_both_lengths(s, t):
    intensity = capacity.attention_intensity_flops_per_byte(t, s)
    assert intensity == pytest.approx(s * t / (s + t))
    assert intensity == pytest.approx(capacity.attention_intensity_flops_per_byte(s, t))
    assert intensity < min(s, t)


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000), st.none() | st.integers(1, 4096))
def test_attended_keys_add_up_over_chunks(first, second, cached, window):
    # Prefilling in two chunks attends to the same query-key pairs as in one: chunked prefill costs no FLOPs.
    total = cached + first + second
    whole = roofline.attended_keys(first + second, total, window)
    chunks = roofline.attended_keys(first, cached + first, window) + roofline.attended_keys(second, total, window)
    assert whole == chunks
    assert whole <= roofline.attended_keys(first + second, total)


# --- this machine -------------------------------------------------------------------------------------------


def test_probe_returns_positive_finite_numbers():
    hw = capacity.measure_this_machine(copy_mib=4, matmul_size=128, repeats=2)
    for value in (hw.peak_flops_per_s, hw.memory_bandwidth_bytes_per_s, hw.ridge_point_flops_per_byte):
        assert math.isfinite(value) and value > 0
    assert hw.dtype == "float32" and hw.memory_bytes >= 0 and "this machine" in hw.name and "measured" in hw.source
    with pytest.raises(ValueError):
        capacity.measure_this_machine(copy_mib=0)
    with pytest.raises(ValueError):
        capacity.measure_this_machine(copy_mib=1, matmul_size=8, repeats=1, dtype="float13")


# --- the profiler on the real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from minserve import LLM

    return LLM("minserve-tiny", max_num_seqs=8)


@pytest.fixture(scope="module")
def profile(llm):
    from minserve.capacity import profiler

    return profiler.profile(
        llm, hardware=H100, prompt_lengths=(8, 48), batch_sizes=(1, 8), context_lengths=(24,), repeats=2, decode_steps=3
    )


def test_profile_points_carry_measurement_and_prediction(llm, profile):
    assert profile.model == "minserve-tiny" and profile.hardware is H100 and profile.dtype == "float32"
    assert [p.prompt_tokens for p in profile.prefill] == [8, 48]
    assert [(d.batch, d.prompt_tokens) for d in profile.decode] == [(1, 24), (8, 24)]
    for p in profile.prefill:
        assert len(p.times_s) == 2 and p.time_s > 0 and p.tokens_per_s > 0
        assert p.predicted == capacity.predict_prefill(llm.model_config, p.prompt_tokens, H100, "float32")
    for d in profile.decode:
        assert len(d.steps_s) == 3 and all(t > 0 for t in d.steps_s)
        assert d.prompt_tokens < d.context_tokens <= d.prompt_tokens + 16  # the prompt and what was generated
        assert d.forward_s is not None and 0 < d.forward_s <= d.step_s  # the forward pass is part of the step
        assert d.predicted == capacity.predict_decode(llm.model_config, d.batch, d.context_tokens, H100, "float32")
        assert d.predicted.bound == "memory"  # a tiny model's decode on an H100
    assert profile.wall_s > 0


def test_decode_step_time_grows_no_faster_than_the_batch(profile):
    # Eight sequences share one pass over the weights: a step of 8 costs far less than 8 steps of 1. The
    # fastest of the batch-8 steps against the median batch-1 step, so one slow step cannot fail the test.
    one, eight = profile.decode
    assert min(eight.steps_s) < 8 * one.step_s
    assert eight.tokens_per_s > one.tokens_per_s / 8


def test_profiler_leaves_the_engine_idle_and_the_cache_unhit(llm, profile):
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
    assert stats["prefix_cache_hit_rate"] == 0.0  # every prompt was fresh


def test_profile_rows_and_dataframe(profile):
    rows = profile.rows()
    assert [r["phase"] for r in rows] == ["prefill", "prefill", "decode", "decode"]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 and r["bound"] in ("compute", "memory") for r in rows)
    frame = profile.to_dataframe()
    assert list(frame.columns) == list(rows[0]) and len(frame) == 4


def test_profiler_refuses_what_it_cannot_measure(llm):
    from minserve import SamplingParams
    from minserve.capacity import profiler

    with pytest.raises(ValueError, match="max_num_seqs"):
        profiler.profile_decode(llm, batch_sizes=(9,), context_lengths=(8,), hardware=H100)
    with pytest.raises(ValueError, match="max_model_len"):
        profiler.profile_prefill(llm, prompt_lengths=(llm.max_model_len,), hardware=H100)
    with pytest.raises(TypeError):
        profiler.profile_prefill(object(), hardware=H100)
    request_id = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="in flight"):
            profiler.profile_prefill(llm, prompt_lengths=(8,), hardware=H100)
    finally:
        llm.cancel(request_id)
        llm.engine.process_aborts()


# --- the command line ---------------------------------------------------------------------------------------


def test_plan_roofline_help():
    result = subprocess.run(
        [sys.executable, "-m", "minserve.cli", "plan", "roofline", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "usage: minserve plan roofline" in result.stdout
    assert "--gpu" in result.stdout and "MI300X" in result.stdout


def test_plan_roofline_prints_the_plan(capsys):
    argv = ["plan", "roofline", "--model", "Llama-3-8B", "--gpu", "H100", "--batch", "1,512", "--context", "1"]
    assert main([*argv, "--prompt", "2048"]) == 0
    out = capsys.readouterr().out
    assert "critical batch size ≈ 295" in out and "H100 SXM" in out
    prefill, small, large = [line.split() for line in out.splitlines() if line.startswith(("prefill", "decode"))]
    assert (prefill[0], prefill[1], prefill[-1]) == ("prefill", "2048", "yes")
    assert "compute" in prefill and "memory" in small and "compute" in large  # batch 512 > 295 at context 1


def test_plan_roofline_on_the_embedded_model(capsys):
    assert main(["plan", "roofline", "--gpu", "l4", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("minserve-tiny:") and "L4" in out


def test_plan_roofline_bad_input_names_the_choices(capsys):
    assert main(["plan", "roofline", "--gpu", "TPU"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'TPU'" in err and "H100" in err and "MI300X" in err and "this" in err
    assert main(["plan", "roofline", "--model", "GPT-5"]) == 2
    assert "Llama-3-8B" in capsys.readouterr().err
    assert main(["plan", "roofline", "--batch", "1,x"]) == 2
    assert "--batch" in capsys.readouterr().err

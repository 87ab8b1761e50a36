"""Chapter 03's checks (``minserve.lab.roofline_checks``) pass on numbers shaped like the real engine's and
fail on those of an engine without the property: one that decodes one sequence per step, whose prefill is
no cheaper per token than decode, whose decode is no longer bound by its weights (re-read or widened every
step, a per-step overhead dwarfing the read, a step faster than the read), whose step ignores the KV cache,
or whose Triton kernel is wrong.

The profiles are made by hand on a toy accelerator (times are chosen, never measured), so nothing here
depends on the machine's speed; the one real measurement checks shapes and arithmetic only.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from minserve import LLM, capacity
from minserve.capacity.profiler import DecodePoint, PrefillPoint, Profile
from minserve.capacity.roofline import Hardware
from minserve.kernels import decode_attention, silu_and_mul
from minserve.lab import kernel_bench, roofline_weights
from minserve.lab import roofline_checks as checks
from minserve.lab.roofline_weights import KVGrowth, WeightBound

# 1 PFLOP/s and 10 TB/s: fast enough that the hand-made costs below, not the bound, make each step.
TOY = Hardware("toy", peak_flops_per_s=1e15, memory_bandwidth_bytes_per_s=1e13, memory_bytes=10**13, dtype="float32")
SMALL = capacity.model_config("Qwen3-0.6B")
BATCHES = (1, 2, 4, 8, 16)


def _profile(prefill_s_per_token=1e-5, fixed_s=2e-3, per_sequence_s=1e-4, slowdown=3.0) -> Profile:
    """Prefill costs ``prefill_s_per_token`` a token (at least ``slowdown`` × its bound); a decode step costs
    ``fixed_s + per_sequence_s × batch`` (at least ``slowdown`` × its bound), with one noisy step per point."""
    prefill = []
    for tokens in (16, 128, 1024):
        pred = capacity.predict_prefill(SMALL, tokens, TOY, "float32")
        t = max(prefill_s_per_token * tokens, slowdown * pred.time_s)
        prefill.append(PrefillPoint(tokens, t, (t,), pred))
    decode = []
    for context in (64, 512):
        for batch in BATCHES:
            pred = capacity.predict_decode(SMALL, batch, context, TOY, "float32")
            t = max(fixed_s + per_sequence_s * batch, slowdown * pred.time_s)
            decode.append(DecodePoint(batch, context, context, t, (t, 5 * t, t), t, pred))
    return Profile("toy", "cpu", "float32", TOY, tuple(prefill), tuple(decode), wall_s=1.0)


def _one_sequence_per_step(profile: Profile) -> Profile:
    """The broken engine: a step of B sequences takes B steps of one."""
    alone = {d.prompt_tokens: d.step_s for d in profile.decode if d.batch == 1}
    decode = tuple(
        DecodePoint(d.batch, d.prompt_tokens, d.context_tokens, d.batch * alone[d.prompt_tokens],
                    (d.batch * alone[d.prompt_tokens],), None, d.predicted)
        for d in profile.decode
    )  # fmt: skip
    return Profile(**{**vars(profile), "decode": decode})


def test_the_checks_pass_on_an_engine_shaped_like_the_real_one():
    profile = _profile()
    checks.check_prefill_beats_decode(profile)
    checks.check_decode_sublinear(profile)


def test_one_sequence_per_step_fails_the_sublinear_check():
    with pytest.raises(AssertionError, match="a step of 8 takes 8.0×"):
        checks.check_decode_sublinear(_one_sequence_per_step(_profile()))
    one_batch = Profile(**{**vars(_profile()), "decode": tuple(d for d in _profile().decode if d.batch == 1)})
    with pytest.raises(AssertionError, match="three or more batch sizes"):  # max_num_seqs=1 profiles batch 1 only
        checks.check_decode_sublinear(one_batch)


def test_the_sublinear_check_survives_a_burst_of_load_on_one_batch_size():
    profile = _profile()
    slowed = tuple(  # every timed step of batch 8 ten times slower: another process took the CPU
        DecodePoint(d.batch, d.prompt_tokens, d.context_tokens, 10 * d.step_s, tuple(10 * t for t in d.steps_s),
                    d.forward_s, d.predicted) if d.batch == 8 else d
        for d in profile.decode
    )  # fmt: skip
    checks.check_decode_sublinear(Profile(**{**vars(profile), "decode": slowed}))


def test_prefill_no_cheaper_than_decode_fails():
    decode_step_s = next(d.step_s for d in _profile().decode if d.batch == 1)  # one decode token's cost
    with pytest.raises(AssertionError, match="prefill"):  # prefill only 5× cheaper per token than decode
        checks.check_prefill_beats_decode(_profile(prefill_s_per_token=decode_step_s / 5))


# SmolLM2-135M in float32 on a 2-core CPU, as measured (2026-12-06, Intel Xeon): 538 MB of weights at ~10 GB/s.
WEIGHTS_B, READ_BPS = 538e6, 10e9


def _weight_bound(steps_ms: dict[int, float], pass_ms: float = 50.0) -> WeightBound:
    """A measured run made by hand: fastest step per batch (ms) and one pass through the weights (ms)."""
    hw = Hardware("cpu", 1e11, READ_BPS, 0, "float32")
    points = tuple(
        DecodePoint(b, 32, 36, t / 1e3, (t / 1e3,), None, capacity.predict_decode(SMALL, b, 36, hw, "float32"))
        for b, t in steps_ms.items()
    )
    return WeightBound("smol", "float32", 2, int(WEIGHTS_B), hw, points, pass_ms / 1e3, ())


BOUND = {1: 58.0, 2: 60.0, 4: 66.0}  # ≈ 538 MB ÷ 10 GB/s = 54 ms, and a batch shares the read


def test_weight_bound_checks_pass_on_a_model_bound_by_its_weights():
    run = _weight_bound(BOUND)
    assert run.weight_read_s == pytest.approx(0.0538)
    checks.check_bound_by_weights(run, within=2.5, overhead_at_most=2.0)
    checks.check_batch_shares_weights(run, batch=4, at_most=2.5)


def test_an_engine_that_re_reads_or_widens_its_weights_every_step_fails():
    widened = _weight_bound({b: 3 * t for b, t in BOUND.items()})  # bf16 widened to fp32: ~3× the bytes a step
    with pytest.raises(AssertionError, match="weight read"):
        checks.check_bound_by_weights(widened, within=2.5, overhead_at_most=4.0)


def test_an_engine_whose_overhead_dwarfs_the_weight_read_fails():
    # The embedded model: 14 MB read from cache in ~0.5 ms, a step of ~3 ms; the step is ~ its DRAM read time.
    tiny = WeightBound("tiny", "float32", 1, 14_000_000, _weight_bound(BOUND).hardware, (), 0.5e-3, ())
    tiny = dataclasses.replace(tiny, points=_weight_bound({1: 2.0, 4: 2.6}).points)
    with pytest.raises(AssertionError, match="pass through its weights"):
        checks.check_bound_by_weights(tiny, within=2.5, overhead_at_most=2.0)
    slow_python = _weight_bound({b: t + 150 for b, t in BOUND.items()})  # 150 ms of per-step overhead
    with pytest.raises(AssertionError):
        checks.check_bound_by_weights(slow_python, within=2.5, overhead_at_most=2.0)


def test_a_step_faster_than_reading_its_weights_fails():
    cached = _weight_bound({1: 10.0, 4: 11.0}, pass_ms=9.0)  # the roof is wrong: the weights were in a cache
    with pytest.raises(AssertionError, match="<"):
        checks.check_bound_by_weights(cached, within=2.5)


def test_an_engine_reading_the_weights_once_per_sequence_fails_the_batch_check():
    per_sequence = _weight_bound({b: b * 58.0 for b in (1, 2, 4)})
    with pytest.raises(AssertionError, match="step of 4"):
        checks.check_batch_shares_weights(per_sequence, batch=4, at_most=2.5)


def _kv(short_ms: float, long_ms: float) -> KVGrowth:
    kv_long = 2 * 1542 * 46080
    return KVGrowth(2, (36, 1542), (short_ms / 1e3, long_ms / 1e3), (541e6, 541e6 + kv_long), (3e6, kv_long), 1e10)


def test_kv_growth_check():
    kv = _kv(58.0, 110.0)  # +90% against +26% of bytes: the torch backend gathers the cache (reads it 3×)
    assert kv.predicted_growth == pytest.approx(0.263, abs=0.01)
    checks.check_kv_growth(kv, share=0.5)
    with pytest.raises(AssertionError, match="bytes say"):  # decode that ignores the cache, or is all overhead
        checks.check_kv_growth(_kv(58.0, 60.0), share=0.5)


def test_weight_bound_on_the_engine_keeps_the_fastest_step_of_each_round():
    llm = LLM(max_num_seqs=4, num_threads=1)
    run = roofline_weights.measure_weight_bound(llm, batches=(1, 2), context=16, rounds=2, steps=2, read_mib=16)
    assert len(run.rounds) == 2 and [p.batch for p in run.points] == [1, 2]
    assert run.step_s(1) <= min(r[1] for _, r in run.rounds)
    assert run.hardware.memory_bandwidth_bytes_per_s == max(bw for bw, _ in run.rounds)
    table = roofline_weights.regime_table({"tiny": run}, batch=2)
    assert table.loc["tiny", "step ÷ weight read"] == pytest.approx(run.step_s(1) / run.weight_read_s)
    kv = roofline_weights.measure_kv_growth(llm, run.hardware, batch=2, contexts=(8, 64), rounds=2, steps=2)
    assert kv.contexts[0] < kv.contexts[1] and kv.bytes[0] < kv.bytes[1] and kv.kv_bytes[1] > kv.kv_bytes[0]
    assert list(roofline_weights.kv_growth_table(kv).index) == list(kv.contexts)


def test_a_broken_kernel_fails_the_kernel_check(monkeypatch):
    table = kernel_bench.kernel_correctness()
    assert list(table.index) == list(kernel_bench.KERNELS)
    checks.check_kernels_match(table)
    monkeypatch.setattr(silu_and_mul, "silu_and_mul", lambda x: silu_and_mul.reference(x) * 1.01)
    broken = kernel_bench.kernel_correctness()
    assert not broken.loc["silu_and_mul", "ok"] and broken.drop("silu_and_mul")["ok"].all()
    with pytest.raises(AssertionError, match="silu_and_mul"):
        checks.check_kernels_match(broken)


def test_a_kernel_that_ignores_the_block_table_fails(monkeypatch):
    def unpaged(query, cache, tables, context_lens, scale, *args, **kwargs):
        straight = torch.arange(tables.shape[1], device=tables.device).expand_as(tables)  # blocks 0, 1, 2…
        return decode_attention.reference(query, cache, straight, context_lens, scale)

    monkeypatch.setattr(decode_attention, "decode_attention", unpaged)
    assert not kernel_bench.kernel_correctness().loc["decode_attention", "ok"]


def test_same_tokens_check():
    checks.check_same_tokens([1, 2, 3], [1, 2, 3])
    with pytest.raises(AssertionError, match="≠"):
        checks.check_same_tokens([1, 2, 4], [1, 2, 3])


def test_recorded_benchmarks_read_what_gpu_check_saves(tmp_path):
    empty, sentence = kernel_bench.recorded_benchmarks(tmp_path)
    assert empty.empty and "No GPU benchmark" in sentence
    report = {"environment": {"gpu": "H200"}, "kernels": [{"kernel": "rotary", "kernel_ms": 0.1, "torch_ms": 0.3}]}
    (tmp_path / "gpu-check-h200.json").write_text(json.dumps(report))
    table, sentence = kernel_bench.recorded_benchmarks(tmp_path)
    assert table.loc[0, "gpu"] == "H200" and table.loc[0, "kernel"] == "rotary" and "gpu-check-h200.json" in sentence
    assert set(kernel_bench.benchmark_shapes().index) == set(kernel_bench.KERNELS)

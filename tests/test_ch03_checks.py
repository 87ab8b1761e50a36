"""Chapter 03's checks (``minserve.lab.roofline_checks``) pass on numbers shaped like the real engine's and
fail on those of an engine without the property: one that decodes one sequence per step, whose prefill is
no cheaper per token than decode, whose points sit above the roofline, or whose Triton kernel is wrong.

The profiles are made by hand on a toy accelerator (times are chosen, never measured), so nothing here
depends on the machine's speed; the one real measurement checks shapes and arithmetic only.
"""

from __future__ import annotations

import json

import pytest
import torch

from minserve import LLM, capacity
from minserve.capacity.profiler import DecodePoint, PrefillPoint, Profile
from minserve.capacity.roofline import Hardware
from minserve.kernels import decode_attention, silu_and_mul
from minserve.lab import kernel_bench, roofline_tables
from minserve.lab import roofline_checks as checks

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
    checks.check_under_the_roof(roofline_tables.profile_table(profile))


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


def test_points_above_the_roof_fail():
    table = roofline_tables.profile_table(_profile(slowdown=3.0))
    checks.check_under_the_roof(table)
    too_fast = table.assign(**{"× bound": 0.5})  # a bound that is no bound: the probe, or the arithmetic, is wrong
    with pytest.raises(AssertionError, match="under the roof"):
        checks.check_under_the_roof(too_fast)


def test_fixed_cost_check_on_paired_numbers():
    real = checks.PairedDecode(batch=16, context=64, alone_s=1.45e-3, batched_s=3.43e-3, rounds=())
    assert real.per_sequence_s == pytest.approx(0.132e-3) and real.fixed_s == pytest.approx(1.318e-3)
    checks.check_fixed_cost_dominates(real)
    unbatched = checks.PairedDecode(batch=16, context=64, alone_s=1.45e-3, batched_s=16 * 1.45e-3, rounds=())
    with pytest.raises(AssertionError, match="fixed"):
        checks.check_fixed_cost_dominates(unbatched)


def test_paired_decode_on_the_engine_keeps_the_fastest_step_of_each_round():
    llm = LLM(max_num_seqs=4)
    paired = checks.paired_decode(llm, TOY, batch=4, context=16, rounds=2, steps=2)
    assert len(paired.rounds) == 2 and paired.batch == 4
    assert paired.alone_s <= min(one for one, _ in paired.rounds)
    assert paired.batched_s <= min(many for _, many in paired.rounds)
    assert paired.fixed_s + paired.per_sequence_s == pytest.approx(paired.alone_s)


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

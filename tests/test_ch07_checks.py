"""Chapter 07's check cells can fail: each check on data with its property, and on data without it."""

import pandas as pd
import pytest
import torch

from minserve.lab import quantization, quantization_checks
from minserve.quant import formats


def _speed(rates: dict[str, float], read: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame({"tokens/s": rates, "read per step (MB)": read})


READ = {"fp32": 538, "bf16": 269, "int8": 135, "int4": 95}
ORDER = ["fp32", "bf16", "int8", "int4"]


def test_round_trip_holds_for_rounding_and_fails_for_truncation(monkeypatch):
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    table = quantization.round_trip_table(weight, ["int8", "int4-g32", "fp8"])
    assert quantization_checks.check_round_trip(table)["int8"] <= 1
    truncating = formats.quantize_int8

    def floor_codes(w):  # truncation: up to a whole step off, twice the bound
        q = truncating(w)
        return formats.QuantizedWeight("int8", torch.floor(w / q.scales[:, None]).to(torch.int8), q.scales)

    monkeypatch.setattr(formats, "quantize_int8", floor_codes)
    with pytest.raises(AssertionError, match="past their bound"):
        quantization_checks.check_round_trip(quantization.round_trip_table(weight, ["int8"]))


KEEPS_UP = {"fp32": 15.0, "bf16": 13.0, "int8": 12.0, "int4": 8.0}  # GB/s each one-row kernel streams
BF16_BEHIND = KEEPS_UP | {"bf16": 7.0}  # the Intel machine's bf16 one-row matmul: half float32's rate


def test_speed_follows_kernels_where_they_keep_up():
    measured = {"fp32": 22.0, "bf16": 43.0, "int8": 69.0, "int4": 83.0}
    result = quantization_checks.check_speed_follows_kernels(_speed(measured, READ), KEEPS_UP, ORDER)
    assert ("fp32", "bf16") in result["judged"] and not result["kernel not faster (not judged)"]
    lost = measured | {"bf16": 21.0}  # half the bytes, a kernel that delivers them, yet no faster
    with pytest.raises(AssertionError, match="a kernel that delivers them, but not faster"):
        quantization_checks.check_speed_follows_kernels(_speed(lost, READ), KEEPS_UP, ORDER)


def test_a_kernel_that_falls_behind_excuses_its_format_but_not_the_packed_ones():
    intel = {"fp32": 27.4, "bf16": 24.8, "int8": 42.3, "int4": 60.4}  # the measurement that broke `make test`
    result = quantization_checks.check_speed_follows_kernels(_speed(intel, READ), BF16_BEHIND, ORDER)
    assert ("fp32", "bf16") in result["kernel not faster (not judged)"]
    widening = intel | {"int4": 15.0}  # fewer bytes stored, more moved (widened every call): slower than fp32
    with pytest.raises(AssertionError, match="packed formats decode only"):
        quantization_checks.check_speed_follows_kernels(_speed(widening, READ), BF16_BEHIND, ORDER)
    barely = intel | {"int8": 30.0}  # faster, but not by a packed gain asked of it
    assert quantization_checks.check_speed_follows_kernels(_speed(barely, READ), BF16_BEHIND, ORDER, packed_gain=1.0)
    with pytest.raises(AssertionError, match="not > 1.3×"):
        quantization_checks.check_speed_follows_kernels(_speed(barely, READ), BF16_BEHIND, ORDER, packed_gain=1.3)


def _quality(kl: dict[str, float], top1: dict[str, float] | None = None) -> pd.DataFrame:
    top1 = top1 or dict.fromkeys(kl, 0.95)
    return pd.DataFrame({"KL (nats/token)": kl, "top-1 agreement": top1})


CLOSE = ["int8", "kv-int8"]


def test_quality_bounds_hold_on_the_measured_shape_and_fail_when_a_format_strays():
    measured = {"int8": 0.0001, "int4-g64": 0.0024, "kv-int8": 0.0001}
    assert quantization_checks.check_quality(_quality(measured), CLOSE, kl_bound=0.01)["int8"] == 0.0001
    with pytest.raises(AssertionError, match="beyond KL"):
        quantization_checks.check_quality(_quality(measured | {"kv-int8": 0.05}), CLOSE, kl_bound=0.01)
    low = dict.fromkeys(measured, 0.95) | {"int8": 0.8}
    with pytest.raises(AssertionError, match="top-1 agreement"):
        quantization_checks.check_quality(_quality(measured, low), CLOSE, top1_above=0.9)


def test_fewer_bits_cost_more_against_a_true_float_model():
    measured = {"int8": 0.0001, "int4-g64": 0.0024}
    assert quantization_checks.check_bits_order(_quality(measured), at_least=3)["ratio"] == pytest.approx(24)
    artefact = {"int8": 0.006, "int4-g64": 0.003}  # a 4-bit "reference": int4 looks closer than int8
    with pytest.raises(AssertionError, match="is not 3"):
        quantization_checks.check_bits_order(_quality(artefact), at_least=3)


def test_regridding_a_4_bit_file_costs_and_fails_when_it_is_free():
    measured = {"int4": 0.003, "int4-g64": 0.27}
    assert quantization_checks.check_regridding(_quality(measured), factor=10)["int4-g64"] == 0.27
    with pytest.raises(AssertionError, match="re-gridding cost"):  # a second rounding that costs nothing
        quantization_checks.check_regridding(_quality(measured | {"int4-g64": 0.004}), factor=10)


def test_smoothing_must_bring_w8a8_closer():
    kl = {"w8a8": 0.40, "w8a8-smooth-0.5": 0.05}
    top1 = {"w8a8": 0.70, "w8a8-smooth-0.5": 0.90}
    assert quantization_checks.check_smoothing(_quality(kl, top1), gain=2)["KL ratio"] == pytest.approx(8)
    with pytest.raises(AssertionError, match="not 2"):  # a migration that moved nothing (s = 1)
        quantization_checks.check_smoothing(_quality(kl | {"w8a8-smooth-0.5": 0.39}, top1), gain=2)
    with pytest.raises(AssertionError, match="top-1"):
        quantization_checks.check_smoothing(_quality(kl, top1 | {"w8a8-smooth-0.5": 0.6}), gain=2)


def test_activation_aware_int4_must_beat_round_to_nearest_at_the_same_bits():
    measured = pd.DataFrame({"KL (nats/token)": {"int4-g64": 0.27, "int4-awq-g64": 0.12},
                             "perplexity": {"int4-g64": 20.3, "int4-awq-g64": 17.0}})  # fmt: skip
    assert quantization_checks.check_activation_aware(measured)["KL ratio"] == pytest.approx(0.27 / 0.12)
    unscaled = measured.assign(**{"KL (nats/token)": [0.27, 0.26]})  # a search that kept α = 0 everywhere
    with pytest.raises(AssertionError, match="not 1.5× below"):
        quantization_checks.check_activation_aware(unscaled)
    worse_perplexity = measured.assign(perplexity=[20.3, 21.0])
    with pytest.raises(AssertionError, match="perplexity"):
        quantization_checks.check_activation_aware(worse_perplexity)


def test_kv_bytes_measured_on_the_engine_and_failing_for_wider_codes_or_per_token_scales():
    capacity = quantization.kv_capacity_table("minserve-tiny", budget_bytes=4 * 2**20)
    shares = quantization_checks.check_kv_bytes(capacity, slack=0.01)
    assert all(0.25 <= share <= 0.2525 for share in shares.values())  # static scales: almost nothing a token
    per_token = capacity["allocated bytes/token"]
    wide = capacity.assign(**{"allocated bytes/token": per_token * [1, 2, 1]})  # int8 codes stored in 16 bits
    with pytest.raises(AssertionError, match="more than"):
        quantization_checks.check_kv_bytes(wide)
    head_dim = 64  # minserve-tiny's: a float16 scale per token and head adds 2 bytes per 64 one-byte codes
    scaled = capacity.assign(**{"allocated bytes/token": per_token * [1, 1 + 2 / head_dim, 1]})
    with pytest.raises(AssertionError, match="more than"):
        quantization_checks.check_kv_bytes(scaled)

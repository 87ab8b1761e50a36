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


def test_speed_follows_bytes_and_fails_a_format_that_widens_its_weight():
    measured = {"fp32": 22.0, "bf16": 43.0, "int8": 69.0, "int4": 83.0}
    assert quantization_checks.check_speed_follows_bytes(_speed(measured, READ), ORDER)["int8 / fp32"] > 3
    widening = measured | {"int4": 40.0}  # fewer bytes stored, more moved: slower than bfloat16
    with pytest.raises(AssertionError, match="half the bytes or fewer, but not faster"):
        quantization_checks.check_speed_follows_bytes(_speed(widening, READ), ORDER)
    barely = {"fp32": 22.0, "bf16": 24.0, "int8": 26.0, "int4": 27.0}
    with pytest.raises(AssertionError, match="not ≥ 1.3×"):
        quantization_checks.check_speed_follows_bytes(_speed(barely, READ), ORDER)


def _quality(kl: dict[str, float], top1: dict[str, float] | None = None) -> pd.DataFrame:
    top1 = top1 or dict.fromkeys(kl, 0.95)
    return pd.DataFrame({"KL (nats/token)": kl, "top-1 agreement": top1})


CLOSE = ["int8", "int4", "kv-int8"]


def test_quality_bounds_hold_on_the_measured_shape_and_fail_when_a_format_strays():
    measured = {"int8": 0.006, "int4": 0.003, "int4-g64": 0.27, "kv-int8": 0.001}
    assert quantization_checks.check_quality(_quality(measured), CLOSE)["int4-g64"] == 0.27
    with pytest.raises(AssertionError, match="beyond KL"):
        quantization_checks.check_quality(_quality(measured | {"kv-int8": 0.05}), CLOSE)
    with pytest.raises(AssertionError, match="re-gridding cost"):  # a second rounding that costs nothing
        quantization_checks.check_quality(_quality(measured | {"int4-g64": 0.004}), CLOSE)
    low = dict.fromkeys(measured, 0.95) | {"int8": 0.8}
    with pytest.raises(AssertionError, match="top-1 agreement"):
        quantization_checks.check_quality(_quality(measured, low), CLOSE)


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


def test_kv_capacity_is_four_times_float32_and_fails_for_codes_as_wide_as_floats():
    capacity = pd.DataFrame({"tokens": {"float32": 1000, "int8": 4000, "fp8": 4000}})
    assert quantization_checks.check_kv_capacity(capacity) == {"int8": 4, "fp8": 4}
    with pytest.raises(AssertionError, match="not 4×"):
        quantization_checks.check_kv_capacity(capacity.assign(tokens=[1000, 3880, 4000]))  # scales per token

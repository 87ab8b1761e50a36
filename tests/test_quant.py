"""Weight quantization: each format's round trip within its stated bound, each quantized linear equal to its
widened weight times the input, the swap's choices and refusals, and the engine on quantized weights."""

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minserve import LLM, SamplingParams
from minserve.quant import QuantizationError, QuantScheme, formats, quantize, quantize_model, weight_bytes
from minserve.quant.formats import max_round_trip_error
from minserve.quant.linear import ACTIVATION_DTYPE, QUANTIZED_LINEARS, e4m3_as_float16
from minserve.quant.swap import layer_formats

FORMATS = ["int8", "int4", "fp8"]


@st.composite
def weights(draw):
    """A [out, in] weight: rows of a random spread, some rows constant or zero, in a multiple of 32 wide."""
    out, groups = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    seed, spread = draw(st.integers(0, 2**31 - 1)), draw(st.floats(1e-4, 1e3))
    w = torch.randn(out, 32 * groups, generator=torch.Generator().manual_seed(seed)) * spread
    if draw(st.booleans()):
        w[0] = 0.0  # a zero row: scale must not be 0
    if out > 1 and draw(st.booleans()):
        w[1] = spread  # a constant row: int4's range is one value
    return w


@settings(max_examples=60, deadline=None)
@given(w=weights(), format=st.sampled_from(FORMATS), group_size=st.sampled_from([32]))
def test_every_element_comes_back_within_the_formats_rounding_bound(w, format, group_size):
    q = quantize(w, format, group_size)
    error = (q.dequantize() - w).abs()
    slack = 1e-6 * w.abs().amax().clamp(min=1e-30)  # float32 arithmetic on the way
    assert torch.all(error <= max_round_trip_error(q, w) + slack), f"{format}: worst {float(error.max()):.3g}"


def test_the_bounds_are_tight_enough_to_fail_a_format_that_drops_a_bit():
    """The bound is no formality: codes rounded to a coarser grid (one bit fewer) break it."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q = quantize(w, "int8")
    coarse = formats.QuantizedWeight("int8", (q.codes // 2) * 2, q.scales)
    assert not torch.all((coarse.dequantize() - w).abs() <= max_round_trip_error(q, w) + 1e-7)


@pytest.mark.parametrize("format", FORMATS)
def test_a_quantized_linear_equals_its_widened_weight_times_the_input(format):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    q = quantize(linear.weight.detach(), format, 64)
    module = QUANTIZED_LINEARS[format](q, linear.bias)
    x = torch.randn(2, 5, 128)  # any leading shape, as nn.Linear takes
    # The kernel's view: activations and scales rounded to bfloat16 where the CPU kernels take them so.
    kernel_dtype = ACTIVATION_DTYPE if format != "fp8" else torch.float32
    seen = q.with_scales_in(kernel_dtype).dequantize()
    expected = F.linear(x.to(kernel_dtype).float(), seen, linear.bias.detach())
    got = module(x)
    assert got.shape == (2, 5, 96) and got.dtype == x.dtype
    tolerance = 2e-2 if format != "fp8" else 1e-4  # bfloat16 output rounding (8 bits), or float32 sums
    assert torch.allclose(got, expected, atol=tolerance * float(expected.abs().max()), rtol=0)
    wrong = F.linear(x, linear.weight.detach() * 1.05, linear.bias.detach())  # a 5% weight error is caught
    assert not torch.allclose(got, wrong, atol=tolerance * float(expected.abs().max()), rtol=0)


def test_e4m3_codes_widen_to_their_exact_values_by_bit_moves_alone():
    every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(every_code.float())
    widened = e4m3_as_float16(every_code).float() * 2.0**8
    assert torch.equal(widened[finite], every_code.float()[finite])


def test_int4_with_a_group_size_that_does_not_tile_a_layer_fails_naming_the_layer_and_the_sizes_that_do():
    model = nn.Sequential()
    model.add_module("down_proj", nn.Linear(576, 16))  # SmolLM2's hidden size: 64 divides it, 128 does not
    before = model.down_proj.weight.clone()
    with pytest.raises(QuantizationError, match=r"down_proj: int4 group size 128 .* 576 .* choose 32 or 64"):
        quantize_model(model, QuantScheme.named("int4", group_size=128))
    assert isinstance(model.down_proj, nn.Linear) and torch.equal(model.down_proj.weight, before), "untouched"


def test_a_layer_no_int4_group_tiles_keeps_int8_and_says_so(caplog):
    model = nn.Sequential()
    model.add_module("down_proj", nn.Linear(688, 16))  # minserve-tiny's intermediate size: 16 × 43
    model.add_module("o_proj", nn.Linear(256, 16))
    with caplog.at_level(logging.INFO, logger="minserve.quant.swap"):
        quantize_model(model, QuantScheme.named("int4"))
    assert layer_formats(model) == {"down_proj": "int8", "o_proj": "int4"}
    assert "down_proj" in caplog.text and "int8" in caplog.text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "int3"}, "unknown quantization 'int3'"),
        ({"quantization": "int4", "quant_group_size": 48}, "group size 48 is not one of 32, 64, 128, 256"),
    ],
)
def test_an_impossible_quantization_fails_before_the_model_loads(options, message, monkeypatch):
    monkeypatch.setattr("minserve.engine.model_setup.load_model", lambda *args: pytest.fail("the model was loaded"))
    with pytest.raises(QuantizationError, match=message):
        LLM(**options)


def test_fp8_on_a_torch_without_float8_says_what_to_do_instead(monkeypatch):
    monkeypatch.setattr("minserve.quant.swap.FP8_DTYPE", None)
    with pytest.raises(QuantizationError, match="float8_e4m3fn.*use int8"):
        LLM(quantization="fp8")


@pytest.fixture(scope="module")
def reference_tokens():
    return [o.token_ids for o in LLM().generate(PROMPTS, GREEDY)]


PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef walk(path):", "class Stack:\n", "The quick brown fox"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# Measured (six prompts, 64 tokens): int8's greedy tokens first differ from float32's after 12 tokens at the
# earliest; int4's after 6, fp8's at once on one prompt (3 mantissa bits on a random tiny model).
INT8_SAME_TOKENS = 8


def test_int8_weights_give_float32s_greedy_tokens_for_the_first_tokens(reference_tokens):
    llm = LLM(quantization="int8")
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert [g[:INT8_SAME_TOKENS] for g in got] == [r[:INT8_SAME_TOKENS] for r in reference_tokens]
    assert set(layer_formats(llm.model).values()) == {"int8"}


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_every_format_serves_and_frees_its_blocks(quantization):
    llm = LLM(quantization=quantization, num_kv_blocks=16)
    outs = llm.generate(PROMPTS * 3, GREEDY)  # more than the cache holds at once: preemption runs too
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs)
    assert llm.stats()["kv_blocks_used"] == 0


def test_quantized_weights_take_fewer_bytes_in_the_order_of_their_bits():
    sizes = {q: weight_bytes(LLM(quantization=q).model) for q in ["none", "int8", "int4"]}
    full = LLM().model
    embedding = full.embed_tokens.weight.numel() * 4  # float32, kept by every scheme
    layers = sizes["none"] - embedding
    assert sizes["int8"] - embedding < 0.3 * layers  # 1 byte a weight against 4, and the scales
    assert sizes["int4"] < sizes["int8"]


def test_an_int4_layer_packed_for_one_device_refuses_to_run_on_another():
    """The CPU packing and the GPU's two-codes-a-byte have one shape: a moved module would read garbage."""
    q = quantize(torch.randn(32, 64), "int4", 32)
    packed_on_cpu = QUANTIZED_LINEARS["int4"](q, None)
    with pytest.raises(RuntimeError, match="packed for the CPU.*quantize on the device it runs on"):
        packed_on_cpu(torch.randn(2, 64, device="meta"))
    on_meta = formats.QuantizedWeight("int4", q.codes.to("meta"), q.scales.to("meta"), q.zeros.to("meta"), 32)
    with pytest.raises(RuntimeError, match="packed for a GPU"):
        QUANTIZED_LINEARS["int4"](on_meta, None)(torch.randn(2, 64))


def test_an_int8_layer_whose_inputs_are_not_a_multiple_of_16_still_equals_its_widened_weight():
    """torch's CPU int8 kernel reads a row 16 inputs at a time (a 344-wide tensor-parallel shard of the tiny
    model's MLP crashed it): such a layer is padded with zero columns, and must give the same product."""
    torch.manual_seed(0)
    linear = nn.Linear(344, 64, bias=False)
    module = QUANTIZED_LINEARS["int8"](quantize(linear.weight.detach(), "int8"), None)
    x = torch.randn(12, 344)
    expected = F.linear(x.to(ACTIVATION_DTYPE).float(), module.dequantized_weight())
    torch.testing.assert_close(module(x), expected, rtol=2e-2, atol=2e-2)
    assert module.dequantized_weight().shape == (64, 344)

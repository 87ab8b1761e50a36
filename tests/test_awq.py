"""Activation-aware int4 (minserve.quant.awq): folding the scales changes no output, the search finds the
columns that meet large inputs, and the engine serves an ``int4-awq`` model."""

from pathlib import Path

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.config import EngineConfig
from minserve.engine.model_setup import quant_scheme
from minserve.model.loader import load_model, resolve_model_path
from minserve.quant import QuantizationError, QuantScheme, quantize_model
from minserve.quant.awq import ALPHA_GRID, best_scale, fold_input_scales, output_error
from minserve.quant.swap import format_options, layer_formats


def _inputs_with_outlier_channels(tokens=256, features=128, outliers=(3, 70), factor=30.0, seed=0):
    """Activations like a real model's: most channels small, a few ``factor`` times larger."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=generator)
    x[:, list(outliers)] *= factor
    return x


def test_the_search_beats_round_to_nearest_where_a_few_input_channels_are_large():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = _inputs_with_outlier_channels()
    rtn = output_error(weight, x, torch.ones(128), group_size=32)
    scale = best_scale(weight, x, 32, ALPHA_GRID)
    assert output_error(weight, x, scale, 32) < 0.7 * rtn  # measured: 0.14 × here
    assert set(scale.topk(2).indices.tolist()) == {3, 70}  # the outlier channels got the largest scales
    # and on other tokens from the same distribution, not only on the tokens it searched
    held_out = _inputs_with_outlier_channels(seed=2)
    assert output_error(weight, held_out, scale, 32) < output_error(weight, held_out, torch.ones(128), 32)


def test_with_even_inputs_the_search_keeps_round_to_nearest_or_close_to_it():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    scale = best_scale(weight, x, 32, ALPHA_GRID)
    assert output_error(weight, x, scale, 32) <= output_error(weight, x, torch.ones(128), 32)
    assert float(scale.max() / scale.min()) < 1.5  # nothing to protect: no channel scaled far from the rest


def _tiny_model():
    return load_model(resolve_model_path("minserve-tiny"), torch.float32, torch.device("cpu"))


def test_folding_scales_leaves_the_float_models_logits_unchanged():
    model = _tiny_model()
    ids = torch.arange(40) % model.config.vocab_size
    before = model.logits_without_cache(ids)
    generator = torch.Generator().manual_seed(0)
    scales = {}
    for i, layer in enumerate(model.layers):
        scales[f"layers.{i}.self_attn.qkv_proj"] = (
            torch.rand(layer.self_attn.qkv_proj.in_features, generator=generator) + 0.5
        )
        scales[f"layers.{i}.mlp.gate_up_proj"] = (
            torch.rand(layer.mlp.gate_up_proj.in_features, generator=generator) + 0.5
        )
        scales[f"layers.{i}.mlp.down_proj"] = torch.rand(layer.mlp.down_proj.in_features, generator=generator) + 0.5
    fold_input_scales(model, scales)
    torch.testing.assert_close(model.logits_without_cache(ids), before, rtol=1e-4, atol=1e-4)
    # the weights did change: a fold that forgot its norm (or its up rows) would move the logits
    assert not torch.allclose(
        model.layers[0].self_attn.qkv_proj.weight, _tiny_model().layers[0].self_attn.qkv_proj.weight
    )


def test_int4_awq_names_round_trip_and_needs_calibration_tokens():
    scheme = QuantScheme.named("int4-awq", 32)
    assert scheme.format == "int4" and scheme.activation_aware and scheme.label == "int4-awq-g32"
    assert QuantScheme.from_label("int4-awq-g32") == scheme
    assert format_options("int4-awq+kv-int8") == {
        "quantization": "int4-awq", "quant_group_size": None, "kv_cache_dtype": "int8"
    }  # fmt: skip
    config = EngineConfig.from_options(quantization="int4-awq")
    assert quant_scheme(config, Path("any"), torch.device("cpu")).activation_aware
    with pytest.raises(QuantizationError, match="calibration"):
        quantize_model(_tiny_model(), scheme)


def test_the_engine_serves_int4_awq_with_the_layers_int4_and_the_scales_folded():
    plain, aware = LLM(quantization="int4"), LLM(quantization="int4-awq")
    assert layer_formats(aware.model) == layer_formats(plain.model)  # the same modules: the scales are folded
    norm = aware.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, plain.model.layers[0].input_layernorm.weight)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = aware.generate(["def fibonacci(n):", "class Stack:\n"], greedy)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert aware.stats()["kv_blocks_used"] == 0

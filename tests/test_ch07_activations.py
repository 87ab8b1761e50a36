"""W8A8 (simulated) and SmoothQuant's migration: the rounding, the identity, and the outliers it tames."""

import torch
from torch import nn

from minserve import LLM
from minserve.quant.activations import (
    W8A8Linear,
    fake_quant_per_token,
    input_channel_max,
    projection_names,
    quantize_w8a8,
    smoothing_scales,
)


def test_per_token_rounding_is_within_half_a_step_of_each_row():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((fake_quant_per_token(x) - x).abs() <= step / 2 + 1e-7).all()


def test_smoothing_is_exact_before_rounding_and_helps_an_input_with_an_outlier_channel():
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, generator=g)
    x[:, 5] *= 100  # one outlier channel, as in a trained transformer's layers
    s = smoothing_scales(x.abs().amax(dim=0), linear.weight, alpha=0.5)
    exact = x @ linear.weight.T
    assert torch.allclose((x / s) @ (linear.weight * s).T, exact, rtol=1e-4, atol=1e-3)
    with torch.no_grad():
        plain = (W8A8Linear.from_linear(linear)(x) - exact).norm()
        smooth = (W8A8Linear.from_linear(linear, s)(x) - exact).norm()
    assert smooth < plain / 2


def test_quantize_w8a8_swaps_every_projection_and_keeps_the_model_close():
    llm = LLM()
    ids = torch.tensor(llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 4))
    reference = llm.model.logits_without_cache(ids)
    names = projection_names(llm.model)
    assert len(input_channel_max(llm.model, ids, names)) == len(names)
    quantize_w8a8(llm.model, ids, alpha=0.5)
    assert all(isinstance(llm.model.get_submodule(n), W8A8Linear) for n in names)
    logits = llm.model.logits_without_cache(ids)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > 0.9

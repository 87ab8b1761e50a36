"""Mixture of experts in minserve's model (Mixtral, Qwen3-MoE).

Logits and greedy tokens against transformers run for every family of ``tests/checkpoints.py``, the MoE ones
included, in ``tests/test_model_parity.py``. Here: the expert load counter against transformers' own router,
the stacked expert layout transformers can save, quantized experts, and what is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.model.errors import CheckpointError
from minserve.model.llama import MLP, SparseMoE
from minserve.model.loader import load_config, load_model
from minserve.quant.formats import QuantizationError
from minserve.quant.linear import QuantizedLinear
from tests.checkpoints import build_hf_model, save_checkpoint

PROMPT = [5, 17, 300, 42, 1024, 7, 99, 1500, 3, 250, 60, 61, 62, 900, 11, 12]


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe-dense-first"])
def checkpoint(request, tmp_path_factory):
    hf_model = build_hf_model(request.param)
    return hf_model, save_checkpoint(hf_model, tmp_path_factory.mktemp(request.param))


def test_each_expert_counts_the_tokens_transformers_routes_to_it(checkpoint):
    hf_model, directory = checkpoint
    ours = load_model(directory)
    ids = torch.tensor(PROMPT)
    ours.logits_without_cache(ids)
    with torch.no_grad():
        router_logits = hf_model(input_ids=ids[None], output_router_logits=True).router_logits
    top_k = ours.config.num_experts_per_tok
    chosen = [scores.topk(top_k).indices.flatten() for scores in router_logits]  # per sparse layer
    expected = torch.stack([torch.bincount(ids, minlength=ours.config.num_experts) for ids in chosen])
    assert torch.equal(ours.expert_load(), expected)
    assert (ours.expert_load().sum(dim=1) == len(PROMPT) * top_k).all()
    ours.reset_expert_load()
    assert ours.expert_load().sum() == 0


def test_sparse_layers_follow_the_config(checkpoint):
    _, directory = checkpoint
    model = load_model(directory)
    config = model.config
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.mlp, SparseMoE if i in config.moe_layers else MLP)
    moe = model.layers[config.moe_layers[0]].mlp
    assert len(moe.experts) == config.num_experts == 4 and moe.top_k == 2
    assert moe.experts[0].intermediate_size == config.moe_intermediate_size


def test_experts_stacked_as_transformers_holds_them_load_like_the_hubs_per_expert_tensors(checkpoint, tmp_path):
    hf_model, directory = checkpoint
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    assert any(name.endswith("experts.gate_up_proj") for name in _tensor_names(tmp_path))  # really stacked
    ids = torch.tensor(PROMPT)
    expected = load_model(directory).logits_without_cache(ids)
    assert torch.equal(load_model(tmp_path).logits_without_cache(ids), expected)


def _tensor_names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return list(f.keys())


def test_the_engine_counts_every_token_it_forwards(checkpoint):
    _, directory = checkpoint
    # an 8-bit cache calibrates its scales on a text first: those tokens are no load the engine served
    llm = LLM(str(directory), dtype="float32", kv_cache_dtype="int8", enable_tracing=False, enable_prefix_caching=False)
    prompts = [PROMPT, PROMPT[:5], [7, 8, 9, 10, 11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    forwarded = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)  # the last token is not fed back
    load = llm.model.expert_load()
    assert load.shape == (len(llm.model.config.moe_layers), 4)
    assert (load.sum(dim=1) == forwarded * 2).all()


def test_int8_quantizes_every_expert_and_keeps_the_router(checkpoint):
    _, directory = checkpoint
    llm = LLM(str(directory), dtype="float32", quantization="int8", enable_tracing=False)
    config = llm.model.config
    moe = llm.model.layers[config.moe_layers[0]].mlp
    assert all(isinstance(e.gate_up_proj, QuantizedLinear) and isinstance(e.down_proj, QuantizedLinear)
               for e in moe.experts)  # fmt: skip
    assert moe.gate.weight.dtype == torch.float32
    float_logits = load_model(directory).logits_without_cache(torch.tensor(PROMPT))
    int8_logits = llm.model.logits_without_cache(torch.tensor(PROMPT))
    # per-channel int8 moves each logit by well under a tenth of their spread (measured: 5 %)
    assert (int8_logits - float_logits).abs().max() < 0.1 * float_logits.std()


def test_int4_awq_is_refused_for_a_mixture_of_experts(checkpoint):
    _, directory = checkpoint
    with pytest.raises(QuantizationError, match="router and experts all read.*int4, int8 or fp8"):
        LLM(str(directory), quantization="int4-awq")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size.*not supported"),
        ({"scoring_func": "sigmoid"}, "scoring_func.*not supported"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be at most the number of experts \(4\)"),
        ({"mlp_only_layers": [2]}, r"mlp_only_layers \[2\] must list layer indices from 0 to 1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_an_unsupported_moe_config_is_refused_before_any_tensor_is_read(tmp_path, change, message):
    directory = save_checkpoint(build_hf_model("qwen3-moe"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_config(directory)


def test_a_mixed_qwen3_moe_config_reads_which_layers_are_sparse(tmp_path):
    directory = save_checkpoint(build_hf_model("qwen3-moe"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "decoder_sparse_step": 2}))
    assert load_config(directory).moe_layers == (1,)  # transformers: sparse where (i + 1) % step == 0

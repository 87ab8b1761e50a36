"""minserve's model against transformers on the same checkpoint: same logits, same greedy continuation."""

from __future__ import annotations

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.model.loader import load_model
from tests.checkpoints import FAMILIES, build_hf_model, save_checkpoint

LOGIT_TOLERANCE = 1e-4  # float32, max absolute difference
PROMPT = [5, 17, 300, 42, 1024, 7, 99, 1500, 3, 250, 60, 61, 62, 900, 11, 12]  # 16 tokens > sliding window 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family = request.param
    hf_model = build_hf_model(family)
    directory = save_checkpoint(hf_model, tmp_path_factory.mktemp(family))
    return family, hf_model, directory


def test_logits_match_transformers(checkpoint):
    family, hf_model, directory = checkpoint
    ours = load_model(directory, torch.float32)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = hf_model(input_ids=ids[None]).logits[0]
    actual = ours.logits_without_cache(ids)
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"{family}: max |Δlogit| = {diff:.2e}"


def test_greedy_continuation_matches_transformers(checkpoint):
    family, hf_model, directory = checkpoint
    new_tokens = 24
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )[0, len(PROMPT) :].tolist()
    llm = LLM(str(directory), dtype="float32", device="cpu")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == expected, family


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf_model = build_hf_model("llama")
    single = load_model(save_checkpoint(hf_model, tmp_path / "single"))
    sharded_dir = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="200KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_model(sharded_dir)
    ids = torch.tensor(PROMPT)
    assert torch.equal(single.logits_without_cache(ids), sharded.logits_without_cache(ids))


def test_bfloat16_load_is_close_to_float32(tmp_path):
    directory = save_checkpoint(build_hf_model("qwen3"), tmp_path)
    ids = torch.tensor(PROMPT)
    full = load_model(directory, torch.float32).logits_without_cache(ids)
    half = load_model(directory, torch.bfloat16).logits_without_cache(ids)
    assert half.dtype == torch.float32  # logits are always returned in float32
    assert (full - half).abs().max().item() < 0.1

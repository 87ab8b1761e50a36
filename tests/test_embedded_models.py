"""The models that ship inside the package: small, complete, loadable by transformers, and trained."""

from __future__ import annotations

import json

import pytest
import torch

from minserve.model.loader import ASSETS_DIR, EMBEDDED_MODELS, load_model
from minserve.model.tokenizer import Tokenizer

MAX_TOTAL_BYTES = 25 * 2**20


def test_embedded_models_are_complete_and_small():
    total = 0
    for name in EMBEDDED_MODELS:
        directory = ASSETS_DIR / name
        for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (directory / required).is_file(), f"{name}/{required}"
        total += sum(f.stat().st_size for f in directory.iterdir())
    assert total < MAX_TOTAL_BYTES


def test_draft_is_several_times_smaller_and_shares_the_tokenizer():
    tiny, draft = (load_model(ASSETS_DIR / name) for name in EMBEDDED_MODELS)
    tiny_params = sum(p.numel() for p in tiny.parameters())
    draft_params = sum(p.numel() for p in draft.parameters())
    assert tiny_params >= 3 * draft_params
    assert tiny.config.num_kv_heads < tiny.config.num_heads  # grouped-query attention
    tokenizers = [(ASSETS_DIR / name / "tokenizer.json").read_text() for name in EMBEDDED_MODELS]
    assert tokenizers[0] == tokenizers[1]


@pytest.mark.parametrize("name", EMBEDDED_MODELS)
def test_transformers_loads_the_embedded_model_and_agrees(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ASSETS_DIR / name
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(directory)
    text = "def fib(n):\n    if n < 2:\n        return n\n"
    ids = hf_tokenizer(text)["input_ids"]
    assert ids == Tokenizer(directory).encode(text)
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([ids])).logits[0]
    actual = load_model(directory).logits_without_cache(torch.tensor(ids))
    assert (actual - expected).abs().max().item() <= 1e-4


def test_tiny_model_beats_the_bigram_baseline_it_was_trained_against():
    report = json.loads((ASSETS_DIR / "training_report.json").read_text())
    tiny = report["models"]["minserve-tiny"]
    assert tiny["held_out_perplexity"] < report["bigram_held_out_perplexity"] / 2

"""The script that trains the embedded models runs end to end (a few steps) and writes loadable models."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from minserve import LLM, SamplingParams

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_models.py"


@pytest.mark.slow
def test_smoke_training_writes_models_minserve_can_serve(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tiny_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    report = module.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "training_report.json").read_text())
    assert saved["models"].keys() == {"minserve-tiny", "minserve-tiny-draft"} == report["models"].keys()
    for name, entry in saved["models"].items():
        assert entry["tokens_trained"] > 0 and entry["held_out_perplexity"] > 1
        out = LLM(str(tmp_path / name)).generate(["def "], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
    assert 0 <= saved["draft_greedy_agreement"] <= 1

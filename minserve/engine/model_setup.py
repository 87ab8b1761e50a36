"""Building the model an engine serves, the same way in every process that holds a part of it.

Load the checkpoint, keep this rank's slice (tensor parallelism, and with ``enable_expert_parallel`` its
whole experts of each mixture of experts: :mod:`minserve.parallel`), quantize, choose the backend, and
with an 8-bit cache measure its scales. Under tensor parallelism every rank runs
these steps in the same order, because two of them run forward passes whose collectives need every rank
at once: activation-aware int4's scale search and the 8-bit cache's calibration (each rank then measures
its own heads).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minserve.config import EngineConfig
from minserve.model.backends import resolve_backend
from minserve.model.kv_quant import CALIBRATION_TOKENS, calibrate_kv_scales, calibration_text
from minserve.model.llama import LlamaForCausalLM
from minserve.model.loader import load_model
from minserve.model.tokenizer import Tokenizer
from minserve.parallel import Communicator, shard_model
from minserve.quant.swap import quantize_model


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
        shard_model(model, comm, expert_parallel=config.enable_expert_parallel)
    scheme = config.quant_scheme(model_dir, device)
    if scheme is not None:
        quantize_model(model, scheme, model_dir, calibration_ids(tokenizer, device))
    model.set_backend(resolve_backend(config.backend, device))
    return model


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

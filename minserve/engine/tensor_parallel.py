"""Tensor parallelism in the engine: ``tensor_parallel_size`` processes, each holding a slice of the model.

The processes are the engine's group of ranks (:mod:`.workers`): rank 0, the engine's own, schedules and
samples; it sends each step's inputs to the other ranks, and every rank builds the same sharded model
(:mod:`minserve.engine.model_setup`, :mod:`minserve.parallel.sharding`) and runs the same forward. The
collectives inside the forward pass keep the ranks in step; the ranks never talk otherwise.

    rank 0 (engine)                         ranks 1 … n−1 (workers)
    schedule ─▶ prepare ─▶ broadcast ─────▶ receive
               forward  ◀── all-reduce ───▶ forward
               logits   ◀── all-gather ───▶ logits (dropped)
               sample

Only rank 0 samples, so the ranks cannot disagree about a token (ranks sampling on their own, with seeds
drifting apart, is how vLLM's bug #17498 gave different tokens per rank). The block tables travel with each
step, so every rank writes its KV heads of a token into the same slot.
"""

from __future__ import annotations

import torch

from minserve.config import EngineConfig
from minserve.engine import model_setup
from minserve.engine.model_runner import ModelRunner
from minserve.engine.workers import (
    COLLECTIVE_TIMEOUT_S,
    ParallelGroup,
    ParallelRunner,
    RankFailure,
    receive_cache_shape,
)
from minserve.parallel import Communicator


def start(config: EngineConfig, device: torch.device) -> ParallelGroup:
    """Spawn ranks 1 … n−1, each building its shard, and join them as rank 0; rank 0's runner sends each
    command on, then runs the same forward as one process (on its own shard)."""
    return ParallelGroup.start(config, device, ParallelRunner, shard_worker, "tensor parallelism")


def shard_worker(rank: int, world_size: int, config: EngineConfig, device: torch.device) -> ModelRunner:
    """A worker rank's runner: its shard of the model, with a KV cache of rank 0's shape for its KV heads."""
    loaded = model_setup.load(config, device, comm=Communicator(rank, world_size))
    return ModelRunner(loaded.model, receive_cache_shape(), loaded.kv_scales)


__all__ = ["COLLECTIVE_TIMEOUT_S", "ParallelGroup", "ParallelRunner", "RankFailure", "shard_worker", "start"]

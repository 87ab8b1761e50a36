"""Chapter 06 exercise, reference solutions (instructors: ``minserve grade ch06 --solutions``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _part(size: int, rank: int, world_size: int, what: str) -> slice:
    """Rank ``rank``'s equal, consecutive share of ``size`` indices."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    if size % world_size:
        raise ValueError(f"{world_size} ranks do not split {size} {what} evenly")
    per_rank = size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def column_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows (output features) ``rank · out / n`` … of ``[out, in]``; a bias ``[out]`` the same way."""
    part = _part(weight.shape[0], rank, world_size, "output features")
    return weight[part].clone()


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Columns (input features) ``rank · in / n`` … of ``[out, in]``."""
    part = _part(weight.shape[1], rank, world_size, "input features")
    return weight[:, part].clone()


def column_parallel_forward(
    x: torch.Tensor, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's output features from the whole input; no communication."""
    return F.linear(x, weight_shard, bias_shard)


def row_parallel_forward(
    x_slice: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None,
    rank: int,
    all_reduce: AllReduce,
) -> torch.Tensor:
    """The partial sum of this rank's input features, the bias added once (rank 0), summed over ranks."""
    partial = x_slice @ weight_shard.T
    if bias is not None and rank == 0:
        partial = partial + bias
    return all_reduce(partial)


def mlp_forward(
    x: torch.Tensor,
    up_weight_shard: torch.Tensor,
    up_bias_shard: torch.Tensor | None,
    down_weight_shard: torch.Tensor,
    down_bias: torch.Tensor | None,
    rank: int,
    all_reduce: AllReduce,
) -> torch.Tensor:
    """Column-parallel up, GELU on the slice, row-parallel down: one all-reduce."""
    hidden = F.gelu(column_parallel_forward(x, up_weight_shard, up_bias_shard))
    return row_parallel_forward(hidden, down_weight_shard, down_bias, rank, all_reduce)

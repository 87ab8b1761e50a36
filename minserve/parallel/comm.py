"""The collectives tensor and expert parallelism need, with every byte counted.

Each of the ``world_size`` ranks holds a slice of every layer. Two operations put the slices back
together (:mod:`.sharding` says where):

* **all-reduce** (sum): each rank has a partial result of the full shape; afterwards every rank has the
  sum. A row-parallel layer's output is such a partial sum: twice per decoder layer, once after attention
  and once after the MLP, a ``[tokens, hidden]`` tensor is all-reduced.
* **all-gather**: each rank has one slice along a dimension; afterwards every rank has them all, end to
  end. The output head's logits are gathered so, one slice of the vocabulary per rank.
* **all-to-all**: each rank sends a different slice of its rows to each rank (sizes chosen per call) and
  receives one from each. Expert parallelism (:mod:`.expert_parallel`) sends tokens to the ranks holding
  their experts this way, and brings the experts' outputs back the same way.

:class:`Communicator` wraps one ``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs) and adds
what each call carries to :class:`Traffic`: the bytes this rank puts in (a tensor's size, however the
backend routes it: a ring all-reduce moves about ``2 (n − 1) / n`` of it over each link) and the seconds
it waits. Chapter 06 holds the count against the formula ``2 × layers × tokens × hidden × bytes``. An
all-to-all counts only the rows that leave the rank: what it keeps for itself never crosses a link.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """What one rank has sent into collectives since the counters were last reset: bytes and seconds."""

    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0
    all_reduce_calls: int = 0
    all_gather_calls: int = 0
    all_to_all_bytes: int = 0  # sent to other ranks only
    all_to_all_calls: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


class Communicator:
    """One rank's view of its tensor-parallel group. ``rank`` 0 … ``world_size`` − 1."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.traffic = Traffic()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over every rank, in place (every rank must call this, in the same order)."""
        start = time.perf_counter()
        dist.all_reduce(tensor, group=self.group)
        self.traffic.seconds += time.perf_counter() - start
        self.traffic.all_reduce_bytes += tensor.numel() * tensor.element_size()
        self.traffic.all_reduce_calls += 1
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` (each the same shape), concatenated along ``dim`` in rank order."""
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        self.traffic.seconds += time.perf_counter() - start
        self.traffic.all_gather_bytes += tensor.numel() * tensor.element_size()
        self.traffic.all_gather_calls += 1
        return torch.cat(parts, dim=dim)

    def all_to_all(self, rows: torch.Tensor, send_sizes: list[int], receive_sizes: list[int]) -> torch.Tensor:
        """Send ``rows[...]`` in consecutive pieces of ``send_sizes[r]`` rows to rank ``r``; return the pieces
        received, ``receive_sizes[r]`` rows from rank ``r``, end to end in rank order (every rank must call this,
        with sizes that agree: what ``r`` sends here is what this rank expects from ``r``)."""
        start = time.perf_counter()
        received = rows.new_empty((sum(receive_sizes), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), receive_sizes, send_sizes, group=self.group)
        self.traffic.seconds += time.perf_counter() - start
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self.traffic.all_to_all_bytes += (sum(send_sizes) - send_sizes[self.rank]) * row_bytes
        self.traffic.all_to_all_calls += 1
        return received

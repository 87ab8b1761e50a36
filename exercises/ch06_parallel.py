"""Chapter 06 exercise: a linear layer split across ranks, column-wise and row-wise, and an MLP built of both.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch06

The grader checks the pieces in one process, then runs your functions on two real ranks over
``torch.distributed`` (gloo, on the CPU) and compares them with the unsplit layer.

**The layout.** A weight is ``[out, in]``, as ``nn.Linear`` stores it: row ``j`` holds the weights output
``j`` multiplies the inputs by, and ``y = x @ W.T + b``. With ``n`` ranks there are two ways to cut it:

- **column-parallel**: each rank keeps ``out / n`` of the *output* features, that is ``out / n`` consecutive
  *rows* of ``W`` (and the same slice of the bias). It reads the whole input and computes its slice of the
  output; no rank needs another's. (The name comes from Megatron-LM's paper, which writes ``Y = X A`` with
  ``A = W.T`` of shape ``[in, out]``: a slice of the output is a slice of ``A``'s *columns*.)
- **row-parallel**: each rank keeps ``in / n`` of the *input* features, ``in / n`` consecutive *columns* of
  ``W`` (rows of ``A``). Given the matching slice of the input, it computes ``x_slice @ W_slice.T``, a
  *partial sum* of the whole output: the full output is the sum over ranks, which one **all-reduce** adds up
  and hands to every rank. The bias belongs to the sum, so exactly one rank (rank 0) adds it.

**The pairing.** An MLP ``down(gelu(up(x)))`` puts the two together: ``up`` column-parallel gives each rank a
slice of the hidden activations; GELU works element by element, so it applies to a slice as it is; and that
slice is exactly the input slice a row-parallel ``down`` needs. One all-reduce per MLP, of the size of its
output (``[tokens, hidden]``), and none in between. A transformer layer does this twice (attention: heads are
split column-wise, the output projection row-wise; then the MLP): two all-reduces a layer.

Slices are consecutive and equal: rank ``r`` of ``n`` keeps indices ``r · size / n`` up to (not including)
``(r + 1) · size / n``. A size that ``n`` does not divide is a ``ValueError`` naming the size and ``n``.

The all-reduce is handed to you as a function, ``all_reduce(tensor) -> tensor``: it returns the sum of every
rank's ``tensor`` (it may sum in place; use what it returns). Every rank must call it the same number of
times, in the same order, or the ranks wait on each other forever (the grader's time limit ends that).

Use only torch and the standard library: the grader refuses a file that imports minserve, whose
``minserve.parallel.sharding`` is an answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def column_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the *output* features: rows ``rank · out / n`` … of ``weight`` ``[out, in]``,
    shape ``[out / n, in]``.

    The same call slices a bias ``[out]`` into ``[out / n]`` (its first and only dimension is the output), so
    write it for dimension 0 of any tensor. Raises ``ValueError`` naming both numbers when ``world_size``
    does not divide ``out``. Return a copy (``.clone()``), so the full weight can be freed.
    """
    raise NotImplementedError


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the *input* features: columns ``rank · in / n`` … of ``weight`` ``[out, in]``,
    shape ``[out, in / n]``. Raises ``ValueError`` naming both numbers when ``world_size`` does not divide
    ``in``. Return a copy."""
    raise NotImplementedError


def column_parallel_forward(
    x: torch.Tensor, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's slice of the layer's output: ``x @ weight_shard.T (+ bias_shard)``.

    ``x`` is the *whole* input, ``[..., in]`` with any leading shape; ``weight_shard`` is
    :func:`column_shard`'s ``[out / n, in]`` and ``bias_shard`` its ``[out / n]`` (or None). The result is
    ``[..., out / n]``: exactly the matching columns of the unsplit layer's output. No communication.
    """
    raise NotImplementedError


def row_parallel_forward(
    x_slice: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None,
    rank: int,
    all_reduce: AllReduce,
) -> torch.Tensor:
    """The layer's *whole* output ``[..., out]``, on every rank, from this rank's slice of the input.

    ``x_slice`` is ``[..., in / n]`` (the input features this rank holds), ``weight_shard`` is
    :func:`row_shard`'s ``[out, in / n]``, and ``bias`` is the *whole* bias ``[out]`` (or None): every rank
    has it, but only rank 0 adds it, before the sum, or it would be counted ``n`` times. Compute the partial
    sum ``x_slice @ weight_shard.T``, add the bias on rank 0, and return ``all_reduce`` of it: one call.
    """
    raise NotImplementedError


def mlp_forward(
    x: torch.Tensor,
    up_weight_shard: torch.Tensor,
    up_bias_shard: torch.Tensor | None,
    down_weight_shard: torch.Tensor,
    down_bias: torch.Tensor | None,
    rank: int,
    all_reduce: AllReduce,
) -> torch.Tensor:
    """A tensor-parallel MLP, ``down(gelu(up(x)))``, with exactly one all-reduce.

    ``x`` is the whole input ``[..., hidden]``. ``up`` is column-parallel (``up_weight_shard`` is
    ``[intermediate / n, hidden]``, ``up_bias_shard`` ``[intermediate / n]``); ``down`` is row-parallel
    (``down_weight_shard`` is ``[hidden, intermediate / n]``, ``down_bias`` the whole ``[hidden]``). Use
    ``torch.nn.functional.gelu`` (its default, exact form) on this rank's slice of the hidden activations:
    it is elementwise, so no rank needs another's slice before ``down``. Returns ``[..., hidden]``, the same
    on every rank, and equal to the unsplit MLP's output.
    """
    raise NotImplementedError

"""Chapter 06's hidden tests (``minserve grade ch06 --hidden``): the public tests' measures on four ranks,
other widths, no bias and batched inputs, so a file fitted to two ranks and the public shapes does not pass
these. The four ranks are threads of this process joined by an all-reduce that waits for all of them and
hands each the sum (a real collective's contract, without spawning processes). Instructors only: this file
sits under ``exercises/solutions/``, which the learner's copy of the course never holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

RANKS = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
HIDDEN, INTERMEDIATE = 24, 96


def _tensors(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


class _ThreadAllReduce:
    """An all-reduce among ``RANKS`` threads: each call waits for every rank's tensor and returns their sum."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(RANKS, timeout=20)
        self.tensors: dict[int, torch.Tensor] = {}
        self.calls: dict[int, list[tuple[int, ...]]] = {rank: [] for rank in range(RANKS)}

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.calls[rank].append(tuple(tensor.shape))
            self.tensors[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.tensors[r] for r in range(RANKS))
            self.barrier.wait()  # every rank has read the sum before the next call overwrites a tensor
            return total

        return all_reduce


def _on_ranks(run: Callable[[int, Callable], torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    """``run(rank, all_reduce)`` on four threads; their outputs, and each rank's all-reduce call shapes."""
    reduce, outputs, errors = _ThreadAllReduce(), [None] * RANKS, []

    def rank_main(rank: int) -> None:
        try:
            with torch.no_grad():
                outputs[rank] = run(rank, reduce.for_rank(rank))
        except Exception as error:  # reported below, with the rank
            errors.append(f"rank {rank}: {type(error).__name__}: {error}")
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[0]
    return outputs, reduce.calls


@pytest.mark.points(2)
def test_four_ranks_shard_other_widths(exercise):
    """A [12, 20] weight over four ranks: column shards are 3 rows each, row shards 5 columns each, and they
    put the weight back together in rank order; a [12] bias shards as the rows do."""
    weight, bias = _tensors(5, (12, 20), (12,))
    columns = [exercise.column_shard(weight, r, RANKS) for r in range(RANKS)]
    rows = [exercise.row_shard(weight, r, RANKS) for r in range(RANKS)]
    assert [tuple(c.shape) for c in columns] == [(3, 20)] * RANKS and [tuple(r.shape) for r in rows] == [(12, 5)] * 4
    assert torch.equal(torch.cat(columns, 0), weight) and torch.equal(torch.cat(rows, 1), weight)
    assert torch.equal(torch.cat([exercise.column_shard(bias, r, RANKS) for r in range(RANKS)]), bias)


@pytest.mark.points(3)
def test_four_ranks_row_parallel_without_a_bias(exercise):
    """Four ranks, no bias, an input of [3, 4, 20]: every rank ends with x @ W.T, summed by one all-reduce."""
    weight, x = _tensors(6, (10, 20), (3, 4, 20))

    def run(rank, all_reduce):
        return exercise.row_parallel_forward(
            x[..., rank * 5 : (rank + 1) * 5], exercise.row_shard(weight, rank, RANKS), None, rank, all_reduce
        )

    outputs, calls = _on_ranks(run)
    for rank, output in enumerate(outputs):
        torch.testing.assert_close(output, x @ weight.T, **TOLERANCE, msg=lambda m, r=rank: f"rank {r}: {m}")
        assert calls[rank] == [(3, 4, 10)], f"rank {rank}: all_reduce calls {calls[rank]}"


@pytest.mark.points(3)
def test_four_ranks_mlp_of_other_widths(exercise):
    """Four ranks, hidden 24 → intermediate 96 → 24 with biases, an input of [2, 5, 24]: every rank ends with
    the unsplit MLP's output, after exactly one all-reduce of [2, 5, 24]."""
    up_w, up_b, down_w, down_b, x = _tensors(7, (INTERMEDIATE, HIDDEN), (INTERMEDIATE,), (HIDDEN, INTERMEDIATE),
                                             (HIDDEN,), (2, 5, HIDDEN))  # fmt: skip
    expected = F.linear(F.gelu(F.linear(x, up_w, up_b)), down_w, down_b)

    def run(rank, all_reduce):
        return exercise.mlp_forward(
            x, exercise.column_shard(up_w, rank, RANKS), exercise.column_shard(up_b, rank, RANKS),
            exercise.row_shard(down_w, rank, RANKS), down_b, rank, all_reduce,
        )  # fmt: skip

    outputs, calls = _on_ranks(run)
    for rank, output in enumerate(outputs):
        torch.testing.assert_close(output, expected, **TOLERANCE, msg=lambda m, r=rank: f"rank {r}: {m}")
        assert calls[rank] == [(2, 5, HIDDEN)], f"rank {rank}: all_reduce calls {calls[rank]}"

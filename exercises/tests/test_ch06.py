"""Graded tests for chapter 06 (``minserve grade ch06``). Each test's docstring is the hint a learner sees.

The pieces are checked first in this process: the shards by hand, and that they put the weight back
together; the column-parallel output against the unsplit layer's; the row-parallel partial sums (with an
all-reduce that sums nothing) against it. Then two real ranks run the layers over ``torch.distributed``
(gloo, the CPU backend), each building the same seeded weights and keeping its slice, cut by the tests
themselves so each function is graded on its own: both ranks must end with the unsplit layer's output, and
the MLP must all-reduce exactly once, ``[tokens, hidden]`` in size. The two ranks are spawned once for all
the tests that need them (a few seconds, most of it importing torch); a scenario that fails stops both
ranks, and the tests after it in that run report why.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD_SIZE = 2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
GROUP_TIMEOUT_S = 20  # a rank whose partner stopped (or called all_reduce a different number of times) gives up
HIDDEN, INTERMEDIATE, IN_FEATURES, OUT_FEATURES = 16, 48, 8, 6


def _tensors(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def _layer():
    """A linear layer [6, 8] with a bias, and an input of 5 tokens."""
    return _tensors(1, (OUT_FEATURES, IN_FEATURES), (OUT_FEATURES,), (5, IN_FEATURES))


def _mlp(leading: tuple[int, ...]):
    """An MLP hidden 16 → intermediate 48 → hidden 16 with biases, and an input of the given leading shape."""
    return _tensors(2, (INTERMEDIATE, HIDDEN), (INTERMEDIATE,), (HIDDEN, INTERMEDIATE), (HIDDEN,), (*leading, HIDDEN))


def _unsplit_mlp(up_w, up_b, down_w, down_b, x):
    return F.linear(F.gelu(F.linear(x, up_w, up_b)), down_w, down_b)


def _rows(tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    per_rank = tensor.shape[0] // n
    return tensor[rank * per_rank : (rank + 1) * per_rank]


def _columns(tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    per_rank = tensor.shape[-1] // n
    return tensor[..., rank * per_rank : (rank + 1) * per_rank]


# --- the shards, by hand ---------------------------------------------------------------------------------------

W = torch.arange(24.0).view(6, 4)  # row j is [4j, 4j + 1, 4j + 2, 4j + 3]


@pytest.mark.points(2)
def test_column_shard_keeps_output_rows(exercise):
    """Column-parallel keeps the *output* features: rows of the [out, in] weight. With 2 ranks, rank 0 keeps
    rows 0–2 and rank 1 rows 3–5, each [3, 4]; a bias [6] splits into [3] the same way."""
    assert exercise.column_shard(W, 0, 2).tolist() == W[:3].tolist()
    assert exercise.column_shard(W, 1, 2).tolist() == W[3:].tolist()
    assert exercise.column_shard(W, 2, 3).tolist() == W[4:].tolist()
    bias = torch.arange(6.0)
    assert exercise.column_shard(bias, 1, 2).tolist() == [3.0, 4.0, 5.0]


@pytest.mark.points(2)
def test_row_shard_keeps_input_columns(exercise):
    """Row-parallel keeps the *input* features: columns of the [out, in] weight. With 2 ranks, rank 0 keeps
    columns 0–1 and rank 1 columns 2–3, each [6, 2]."""
    assert exercise.row_shard(W, 0, 2).tolist() == W[:, :2].tolist()
    assert exercise.row_shard(W, 1, 2).tolist() == W[:, 2:].tolist()
    assert exercise.row_shard(W, 3, 4).tolist() == W[:, 3:].tolist()


@pytest.mark.points(1)
def test_shards_put_the_weight_back_together(exercise):
    """Every rank's shard, end to end in rank order, is the whole weight again (column shards along the rows,
    row shards along the columns), for 1, 2 and 4 ranks; and a shard is a copy, not a view of the weight."""
    (weight,) = _tensors(0, (8, 12))
    for n in (1, 2, 4):
        torch.testing.assert_close(torch.cat([exercise.column_shard(weight, r, n) for r in range(n)], 0), weight)
        torch.testing.assert_close(torch.cat([exercise.row_shard(weight, r, n) for r in range(n)], 1), weight)
    shard = exercise.column_shard(weight, 0, 2)
    shard.zero_()
    assert weight.abs().sum() > 0, "zeroing a shard changed the full weight: return a copy (.clone())"


@pytest.mark.points(1)
def test_a_size_that_does_not_split_is_an_error(exercise):
    """3 ranks cannot split 4 input features (nor 8 output features) evenly: ValueError, and the message names
    both numbers."""
    weight = torch.zeros(8, 4)
    with pytest.raises(ValueError) as raised:
        exercise.row_shard(weight, 0, 3)
    assert "3" in str(raised.value) and "4" in str(raised.value), f"message: {raised.value}"
    with pytest.raises(ValueError) as raised:
        exercise.column_shard(weight, 0, 3)
    assert "3" in str(raised.value) and "8" in str(raised.value), f"message: {raised.value}"


# --- the layers, in one process ----------------------------------------------------------------------------------


@pytest.mark.points(2)
@pytest.mark.parametrize("leading", [(5,), (2, 3)], ids=["tokens", "batch-tokens"])
def test_column_parallel_output_is_a_slice_of_the_full_output(exercise, leading):
    """column_parallel_forward(x, W_shard, b_shard) is exactly the rank's columns of x @ W.T + b, for x of any
    leading shape; the ranks' outputs side by side are the whole output."""
    weight, bias, x = _tensors(3, (OUT_FEATURES, IN_FEATURES), (OUT_FEATURES,), (*leading, IN_FEATURES))
    full = F.linear(x, weight, bias)
    parts = [exercise.column_parallel_forward(x, _rows(weight, r, 2), _rows(bias, r, 2)) for r in range(2)]
    for rank, part in enumerate(parts):
        assert part.shape == (*leading, OUT_FEATURES // 2)
        torch.testing.assert_close(part, _columns(full, rank, 2), **TOLERANCE)
    torch.testing.assert_close(exercise.column_parallel_forward(x, weight), x @ weight.T, **TOLERANCE)


@pytest.mark.points(2)
def test_row_parallel_partial_sums_add_up_to_the_full_layer(exercise):
    """With an all-reduce that sums nothing (it hands back its input), each rank's result is its partial sum
    x_slice @ W_slice.T, the bias added by rank 0 alone: the partial sums add up to x @ W.T + b, bias counted
    once. all_reduce is called exactly once per call."""
    weight, bias, x = _layer()
    calls = []

    def record(tensor):
        calls.append(tensor.shape)
        return tensor

    parts = [
        exercise.row_parallel_forward(_columns(x, r, 2), _columns(weight, r, 2), bias, r, record) for r in range(2)
    ]
    assert calls == [(5, OUT_FEATURES)] * 2, f"all_reduce calls (their shapes): {calls}"
    torch.testing.assert_close(parts[0] + parts[1], F.linear(x, weight, bias), **TOLERANCE)
    torch.testing.assert_close(parts[1], _columns(x, 1, 2) @ _columns(weight, 1, 2).T, **TOLERANCE)


# --- two ranks over gloo -----------------------------------------------------------------------------------------

SCENARIOS = ("row_parallel", "mlp_tokens", "mlp_batch_tokens")


def _counting_all_reduce(log: list[int]):
    """The all-reduce handed to the learner: a real one over gloo, each call's bytes logged."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.all_reduce(tensor)
        log.append(tensor.numel() * tensor.element_size())
        return tensor

    return all_reduce


def _scenario(name: str, exercise, rank: int, all_reduce) -> torch.Tensor:
    """One scenario on one rank, from the same seeded tensors as the unsplit reference, cut by the test."""
    if name == "row_parallel":
        weight, bias, x = _layer()
        return exercise.row_parallel_forward(_columns(x, rank, 2), _columns(weight, rank, 2), bias, rank, all_reduce)
    up_w, up_b, down_w, down_b, x = _mlp((7,) if name == "mlp_tokens" else (2, 3))
    return exercise.mlp_forward(
        x, _rows(up_w, rank, 2), _rows(up_b, rank, 2), _columns(down_w, rank, 2), down_b, rank, all_reduce
    )


def _rank_main(rank: int, exercise_path: str, scratch: str) -> None:
    """What each spawned rank runs: every scenario in order, its output and all-reduce log saved; the first
    failure stops this rank (its partner then gives up within the group's timeout)."""
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location(f"ch06_exercise_rank{rank}", exercise_path)
    exercise = importlib.util.module_from_spec(spec)
    results: dict[str, dict] = {}
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))  # fmt: skip
    try:
        spec.loader.exec_module(exercise)
        for name in SCENARIOS:
            log: list[int] = []
            try:
                with torch.no_grad():
                    output = _scenario(name, exercise, rank, _counting_all_reduce(log))
                results[name] = {"output": output, "all_reduce_bytes": log}
            except Exception as error:  # the learner's bug, reported by the test that reads this scenario
                results[name] = {"error": _describe(error)}
                break
    except Exception as error:
        results["load"] = {"error": _describe(error)}
    finally:
        torch.save(results, os.path.join(scratch, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _describe(error: Exception) -> str:
    """One short line: the error and where it was raised; for a collective that failed (the partner rank
    stopped, or called all_reduce a different number of times), that first."""
    if isinstance(error, dist.DistBackendError) or "gloo" in str(error):
        return "the other rank stopped or called all_reduce a different number of times: " + str(error)[:80]
    where = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {error} (line {where.lineno} of {Path(where.filename).name})"


@functools.cache
def _two_ranks(exercise_path: str) -> list[dict]:
    """Run the scenarios on two gloo ranks, once per exercise file; each rank's results."""
    with tempfile.TemporaryDirectory(prefix="minserve-ch06-") as scratch:
        mp.spawn(_rank_main, args=(exercise_path, scratch), nprocs=WORLD_SIZE)
        return [torch.load(os.path.join(scratch, f"rank{r}.pt")) for r in range(WORLD_SIZE)]


def _outputs(exercise, name: str) -> list[dict]:
    """Both ranks' results of one scenario; fails with the first rank's error if a rank did not finish it."""
    ranks = _two_ranks(str(Path(exercise.__file__).resolve()))
    for rank, results in enumerate(ranks):
        result = results.get(name) or results.get("load") or {}
        if "output" not in result:
            earlier = next((f"{n}: {r['error']}" for n, r in results.items() if "error" in r), "it did not run")
            pytest.fail(f"rank {rank} did not finish {name!r} ({earlier})")
    return [results[name] for results in ranks]


@pytest.mark.points(3)
def test_row_parallel_over_gloo_gives_every_rank_the_full_output(exercise):
    """On two real ranks, row_parallel_forward(x_slice, W_slice, bias, rank, all_reduce) returns x @ W.T + b on
    both: each rank's partial sum, the bias added by rank 0 only, summed by one all_reduce."""
    weight, bias, x = _layer()
    expected = F.linear(x, weight, bias)
    for rank, result in enumerate(_outputs(exercise, "row_parallel")):
        assert result["output"].shape == expected.shape, f"rank {rank}"
        torch.testing.assert_close(result["output"], expected, **TOLERANCE, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.points(3)
@pytest.mark.parametrize(("name", "leading"), [("mlp_tokens", (7,)), ("mlp_batch_tokens", (2, 3))])
def test_mlp_over_gloo_equals_the_unsplit_mlp(exercise, name, leading):
    """On two real ranks, mlp_forward returns down(gelu(up(x))) of the unsplit MLP on both, for x of shape
    [tokens, hidden] and [batch, tokens, hidden]: up column-parallel, GELU on each rank's slice, down
    row-parallel."""
    expected = _unsplit_mlp(*_mlp(leading))
    for rank, result in enumerate(_outputs(exercise, name)):
        assert result["output"].shape == expected.shape, f"rank {rank}"
        torch.testing.assert_close(result["output"], expected, **TOLERANCE, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.points(2)
@pytest.mark.parametrize(("name", "tokens"), [("row_parallel", 5), ("mlp_tokens", 7), ("mlp_batch_tokens", 6)])
def test_one_all_reduce_of_the_output_size(exercise, name, tokens):
    """Each layer all-reduces exactly once, a float32 tensor of [tokens, out] — the MLP's is [tokens, hidden]
    after down, never the [tokens, intermediate] slice after up: an all-reduce there would add the ranks'
    different slices together."""
    width = OUT_FEATURES if name == "row_parallel" else HIDDEN
    for rank, result in enumerate(_outputs(exercise, name)):
        assert result["all_reduce_bytes"] == [tokens * width * 4], f"rank {rank}: bytes per call"

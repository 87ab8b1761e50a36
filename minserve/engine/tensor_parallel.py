"""Tensor parallelism in the engine: ``tensor_parallel_size`` processes, each holding a slice of the model.

The engine's own process is rank 0. It keeps everything that decides (the scheduler, the block manager,
the sampler) exactly as with one process; only its executor changes, to a :class:`ParallelRunner`: a
:class:`~minserve.engine.model_runner.ModelRunner` that first sends each step's inputs to the other ranks.
Ranks 1 … n−1 are worker processes the engine spawns when it starts (:func:`worker_main`). Each builds the
same sharded model (:mod:`minserve.engine.model_setup`), then loops: receive a command, run it, wait for the
next. The collectives inside the forward pass keep the ranks in step; the ranks never talk otherwise.

    rank 0 (engine)                         ranks 1 … n−1 (workers)
    schedule ─▶ prepare ─▶ broadcast ─────▶ receive
               forward  ◀── all-reduce ───▶ forward
               logits   ◀── all-gather ───▶ logits (dropped)
               sample

Only rank 0 samples, so the ranks cannot disagree about a token (ranks sampling on their own, with seeds
drifting apart, is how vLLM's bug #17498 gave different tokens per rank). The block tables travel with each
step, so every rank writes its KV heads of a token into the same slot.

A rank that dies fails the next collective: gloo reports the closed connection, and a collective that
hears nothing times out after ``COLLECTIVE_TIMEOUT_S``; the engine then raises rather than hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from minserve.config import EngineConfig
from minserve.engine.model_runner import ModelRunner
from minserve.parallel import Communicator

COLLECTIVE_TIMEOUT_S = 120.0  # a collective that waits this long for a rank fails instead of hanging
STOP, FORWARD, SWAP, CLEAR = "stop", "forward", "swap", "clear"


class ParallelGroup:
    """Rank 0's handle on the group: its :class:`Communicator`, and the worker processes it started."""

    def __init__(self, comm: Communicator, workers: list[multiprocessing.process.BaseProcess]) -> None:
        self.comm, self.workers = comm, workers
        self.failed: str | None = None  # why the group can no longer run, once a rank has stopped
        # An engine dropped without shutdown() cannot tell its workers to stop: they are killed instead.
        self._finalizer = weakref.finalize(self, _kill, workers)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> ParallelGroup:
        """Spawn ranks 1 … n−1 and join them as rank 0 (blocks until every rank has joined)."""
        world_size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("one tensor-parallel engine per process: shut the other down first (engine.shutdown())")
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads
        workers = [
            context.Process(target=worker_main, args=(rank, world_size, address, config), daemon=True)
            for rank in range(1, world_size)
        ]
        for worker in workers:
            worker.start()
        _join(0, world_size, address, device)
        return cls(Communicator(0, world_size), workers)

    def runner(self, model, num_blocks: int, *cache: Any) -> ParallelRunner:
        """Rank 0's executor; the workers learn the cache's shape from it and allocate theirs alike."""
        with self.watching():
            _broadcast((num_blocks, *cache[:-1]))  # the block counts and dtype; each rank measured its own scales
        return ParallelRunner(self, model, num_blocks, *cache)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Turn a collective's failure into a :class:`RankFailure` naming the ranks that stopped; once one has,
        every later command fails at once instead of waiting out a timeout."""
        if self.failed is not None:
            raise RankFailure(self.failed)
        try:
            yield
        except RuntimeError as error:
            stopped = {rank: w.exitcode for rank, w in enumerate(self.workers, start=1) if not w.is_alive()}
            who = f"rank(s) {stopped} (rank: exit code) stopped" if stopped else "a collective failed"
            self.failed = (f"tensor parallelism: {who}; the engine cannot go on without every rank: start a new "
                           f"one ({error})")  # fmt: skip
            raise RankFailure(self.failed) from error

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them, and leave the group."""
        if self._finalizer.alive and self.failed is None:
            _broadcast((STOP,))
            for worker in self.workers:
                worker.join(timeout=10)
        self._finalizer()  # any that did not stop, or all of them after a failure; and leave the group


class RankFailure(RuntimeError):
    """A tensor-parallel rank stopped: the model is incomplete without it, so the engine cannot go on."""


class ParallelRunner(ModelRunner):
    """Rank 0's model runner: every command is sent to the other ranks before it runs here."""

    def __init__(self, group: ParallelGroup, *args: Any) -> None:
        super().__init__(*args)
        self.group = group

    def logits(self, input_ids, positions, meta, rows):
        with self.group.watching():
            _broadcast((FORWARD, input_ids, positions, meta, rows))
            return super().logits(input_ids, positions, meta, rows)

    def swap(self, swap_out, swap_in):
        if swap_out or swap_in:
            with self.group.watching():
                _broadcast((SWAP, swap_out, swap_in))
        super().swap(swap_out, swap_in)

    def clear(self, block_ids):
        if block_ids:
            with self.group.watching():
                _broadcast((CLEAR, block_ids))
        super().clear(block_ids)


def worker_main(rank: int, world_size: int, address: str, config: EngineConfig) -> None:
    """A worker rank: build this rank's shard, then run what rank 0 sends until it says stop."""
    from minserve.engine.model_setup import build_model, kv_scales
    from minserve.model.kv_quant import resolve_kv_cache_dtype
    from minserve.model.loader import load_config, resolve_dtype, resolve_model_path
    from minserve.model.tokenizer import Tokenizer

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = torch.device(f"cuda:{rank}") if config.device.startswith("cuda") else torch.device("cpu")
    _join(rank, world_size, address, device)
    model_dir = resolve_model_path(config.model)
    tokenizer = Tokenizer(model_dir)
    dtype = resolve_dtype(config.dtype, load_config(model_dir), device)
    model = build_model(config, model_dir, device, dtype, tokenizer, Communicator(rank, world_size))
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    scales = kv_scales(model, tokenizer, kv_dtype, device)
    num_blocks, block_size, num_cpu_blocks, _ = _broadcast(None)
    runner = ModelRunner(model, num_blocks, block_size, num_cpu_blocks, kv_dtype, scales)
    with torch.inference_mode():
        while (command := _broadcast(None))[0] != STOP:
            kind, *args = command
            if kind == FORWARD:
                runner.logits(*args)
            elif kind == SWAP:
                runner.swap(*args)
            elif kind == CLEAR:
                runner.clear(*args)
    dist.destroy_process_group()
    # Leave without running C++ static destructors: gloo's threads can still be winding down, and destroying
    # them then aborts the process ("terminate called without an active exception"), one exit in a few.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join(rank: int, world_size: int, address: str, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout)


def _broadcast(message: tuple | None) -> tuple:
    """Rank 0's ``message`` to every rank (pickled; the tensors of a step are a few kilobytes)."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _kill(workers: list[multiprocessing.process.BaseProcess]) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.kill()
        worker.join()
    if dist.is_initialized():  # so that this process can start another group
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["COLLECTIVE_TIMEOUT_S", "ParallelGroup", "ParallelRunner", "RankFailure", "worker_main"]

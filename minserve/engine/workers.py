"""The ranks around the engine: spawned, joined, sent every command, watched, stopped.

Tensor and pipeline parallelism (:mod:`.tensor_parallel`, :mod:`.pipeline_parallel`) split the model
differently but run their processes alike. The engine's own process is rank 0. It keeps everything that
decides (the scheduler, the block manager, the sampler) exactly as with one process; only its executor
changes, to a :class:`ParallelRunner`: a :class:`~minserve.engine.model_runner.ModelRunner` that first sends
each command to the other ranks. Ranks 1 … n−1 are worker processes the engine spawns when it starts
(:func:`worker_main`). Each builds its part of the model and its runner (a function the parallelism
supplies), then loops: receive a command, run it, wait for the next.

    rank 0 (engine)                         ranks 1 … n−1 (workers)
    schedule ─▶ prepare ─▶ broadcast ─────▶ receive
               forward  ◀── the parallelism's own traffic ──▶ forward
               sample

A command is the name of a runner method and its arguments, so a worker runs ``runner.logits(...)``,
``runner.swap(...)`` or ``runner.clear(...)`` just as rank 0 does. The block tables travel with each step,
so every rank writes its part of a token's keys and values into the same slot.

A rank that dies fails the next collective: gloo reports the closed connection, and a collective that
hears nothing times out after ``COLLECTIVE_TIMEOUT_S``; the engine then raises :class:`RankFailure` rather
than hangs.

**Across machines**, the engine cannot spawn the other ranks itself: a launcher starts one process per rank
on every machine, and ``torchrun`` is the one PyTorch ships. Every process runs the same command; each learns
its place from the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and
``MASTER_ADDR``/``MASTER_PORT``, where rank 0's machine keeps the rendezvous store), :func:`launched_rank`
reads it, and the group is joined with ``init_method="env://"``. Rank 0 runs the engine (and the server);
every other rank runs :func:`worker_main` instead, on GPU ``LOCAL_RANK`` of its machine::

    # on each of two machines, one GPU each (node 0 is 10.0.0.1):
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank {0,1} --master-addr 10.0.0.1 --master-port 29500 \
        -m minserve.cli serve --model ... --tensor-parallel-size 2
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minserve.config import EngineConfig
from minserve.engine.model_runner import CacheShape, ModelRunner
from minserve.engine.spawning import spawning_without_the_main_script
from minserve.parallel import Communicator

COLLECTIVE_TIMEOUT_S = 120.0  # a collective that waits this long for a rank fails instead of hanging
JOINING_KEY = "minserve/joining/"  # + rank: set in rank 0's store by a spawned worker on its way into the group
# Commands: the runner methods a worker calls, "gather" (call one and send its answer back), and "stop".
STOP, FORWARD, SWAP, CLEAR, GATHER = "stop", "logits", "swap", "clear", "gather"

# What a worker builds after joining: its runner, from (rank, world_size, config, device). A module-level
# function, so that the spawned process can find it by name.
WorkerRunner = Callable[[int, int, EngineConfig, torch.device], ModelRunner]


class RankFailure(RuntimeError):
    """A rank stopped: the model is incomplete without it, so the engine cannot go on."""


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a group a launcher started: its ``rank`` of ``world_size``, and its
    ``local_rank`` among the ranks on its own machine (which GPU it takes)."""

    rank: int
    world_size: int
    local_rank: int


def launched_rank() -> LaunchedRank | None:
    """This process's place from torchrun's environment, or None when no launcher started it."""
    env = os.environ
    if not all(name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return LaunchedRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


def check_launch(launched: LaunchedRank, world_size: int) -> None:
    """Refuse a launch of another size than the configuration's ``world_size`` (tensor × pipeline ranks)."""
    if launched.world_size != world_size:
        raise ValueError(
            f"the launcher started {launched.world_size} processes (WORLD_SIZE) but the configuration asks for "
            f"{world_size}: give torchrun --nnodes × --nproc-per-node = {world_size}, or set "
            "--tensor-parallel-size or --pipeline-parallel-size to the processes started"
        )


class ParallelGroup:
    """Rank 0's handle on the group: its :class:`Communicator`, the worker processes it started, and the
    class of rank 0's runner."""

    def __init__(
        self,
        comm: Communicator,
        workers: list[multiprocessing.process.BaseProcess],
        runner_cls: type[ParallelRunner],
        config: EngineConfig,
        name: str,
    ) -> None:
        self.comm, self.workers, self.runner_cls, self.config, self.name = comm, workers, runner_cls, config, name
        self.failed: str | None = None  # why the group can no longer run, once a rank has stopped
        # An engine dropped without shutdown() cannot tell its workers to stop: they are killed instead.
        self._finalizer = weakref.finalize(self, _kill, workers)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        device: torch.device,
        runner_cls: type[ParallelRunner],
        worker_runner: WorkerRunner,
        name: str,
    ) -> ParallelGroup:
        """Spawn ranks 1 … n − 1 (``config.parallel.world_size``), each building its runner with ``worker_runner``, and
        join them as rank 0 (blocks until every rank has joined). ``name`` says which parallelism, in errors."""
        world_size = config.parallel.world_size
        if dist.is_initialized():
            raise RuntimeError(f"one {name} engine per process: shut the other down first (engine.shutdown())")
        if (launched := launched_rank()) is not None:  # torchrun started every rank: join them, spawn none
            check_launch(launched, world_size)
            if launched.rank != 0:
                raise RuntimeError(f"{name}: rank {launched.rank} runs worker_main, not the engine (rank 0 does)")
            _join(0, world_size, "env://", device)
            return cls(Communicator(0, world_size), [], runner_cls, config, name)
        store = _listen(world_size)  # rank 0's rendezvous, open before any worker looks for it
        address = f"tcp://127.0.0.1:{store.port}"
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads
        workers = [
            context.Process(target=worker_main, args=(rank, world_size, address, config, worker_runner), daemon=True)
            for rank in range(1, world_size)
        ]
        with spawning_without_the_main_script():
            for worker in workers:
                worker.start()
        try:
            _wait_for_workers(store, workers, name)
            _join(0, world_size, address, device, store)
        except BaseException:
            _kill(workers)
            raise
        return cls(Communicator(0, world_size), workers, runner_cls, config, name)

    def runner(self, model, shape: CacheShape, kv_scales: list[torch.Tensor] | None) -> ParallelRunner:
        """Rank 0's executor; the workers learn the cache's shape from it and allocate theirs alike (each rank
        measured its own heads' 8-bit scales)."""
        with self.watching():
            send((shape,))
        return self.runner_cls(self, model, shape, kv_scales)

    def gather(self, method: str, mine: Any, *args: Any) -> list:
        """Every rank's answer to ``runner.method(*args)``, in rank order; rank 0's own is ``mine``."""
        answers: list = [None] * self.comm.world_size
        with self.watching():
            send((GATHER, method, *args))
            dist.gather_object(mine, answers, dst=0)
        return answers

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
            self.failed = (f"{self.name}: {who}; the engine cannot go on without every rank: start a new "
                           f"one ({error})")  # fmt: skip
            raise RankFailure(self.failed) from error

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them, and leave the group."""
        if self._finalizer.alive and self.failed is None:
            send((STOP,))
            for worker in self.workers:
                worker.join(timeout=10)
        self._finalizer()  # any that did not stop, or all of them after a failure; and leave the group


class ParallelRunner(ModelRunner):
    """Rank 0's model runner: every command is sent to the other ranks before it runs here.

    Under tensor parallelism what runs here is the plain :class:`ModelRunner`'s; a parallelism whose ranks
    run something else puts its runner after this one in its class's bases, so that ``super()`` reaches it
    (:class:`~minserve.engine.pipeline_parallel.PipelineRunner`).
    """

    def __init__(self, group: ParallelGroup, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self._collective_s = 0.0

    @property
    def collective_s(self) -> float:
        """Seconds the last forward pass spent in this rank's counted collectives (tensor and expert
        parallelism's; a pipeline's point-to-point hand-offs are not collectives): the trace shows them per step."""
        return self._collective_s

    def logits(self, input_ids, positions, meta, rows):
        waited_s = self.group.comm.traffic.seconds
        with self.group.watching():
            send((FORWARD, input_ids, positions, meta, rows))
            logits = super().logits(input_ids, positions, meta, rows)
        self._collective_s = self.group.comm.traffic.seconds - waited_s
        return logits

    def swap(self, swap_out, swap_in):
        if swap_out or swap_in:
            with self.group.watching():
                send((SWAP, swap_out, swap_in))
        super().swap(swap_out, swap_in)

    def clear(self, block_ids):
        if block_ids:
            with self.group.watching():
                send((CLEAR, block_ids))
        super().clear(block_ids)


def worker_main(
    rank: int,
    world_size: int,
    address: str,
    config: EngineConfig,
    worker_runner: WorkerRunner,
    local_rank: int | None = None,
) -> None:
    """A worker rank: build this rank's runner, then run what rank 0 sends until it says stop. On a GPU it
    takes GPU ``local_rank`` of its machine (by default ``rank``: every rank on one machine)."""
    if config.device.num_threads is not None:
        torch.set_num_threads(config.device.num_threads)
    gpu = rank if local_rank is None else local_rank
    device = torch.device(f"cuda:{gpu}") if config.device.device.startswith("cuda") else torch.device("cpu")
    _join(rank, world_size, address, device)
    ignore_stop_signals()  # joined: from here rank 0 says when to stop
    runner = worker_runner(rank, world_size, config, device)
    with torch.inference_mode():
        while (command := receive())[0] != STOP:
            method, *args = command
            if method == GATHER:
                name, *args = args
                dist.gather_object(getattr(runner, name)(*args), None, dst=0)
            else:
                getattr(runner, method)(*args)
    dist.destroy_process_group()
    # Leave without running C++ static destructors: gloo's threads can still be winding down, and destroying
    # them then aborts the process ("terminate called without an active exception"), one exit in a few.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ignore_stop_signals() -> None:
    """Let SIGINT and SIGTERM pass this process by: for a process whose life its owner manages (the engine
    core, a worker rank). Ctrl-C in a terminal, torchrun and a service manager stopping a unit signal the
    whole process group; a core or rank that died of it would fail the requests the server is still
    draining, and the front end would take the death for a failure and start a new core. Such a process ends
    when its owner says stop, or when its pipe or collective breaks because the owner is gone."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)


def receive_cache_shape() -> CacheShape:
    """The :class:`CacheShape` rank 0 sends from :meth:`ParallelGroup.runner`."""
    (shape,) = receive()
    return shape


def send(message: tuple) -> None:
    """Rank 0's ``message`` to every rank (pickled; the tensors of a step are a few kilobytes)."""
    dist.broadcast_object_list([message], src=0)


def receive() -> tuple:
    """What rank 0 sent with :func:`send`."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _listen(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``), for the workers it spawns."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def _wait_for_workers(store: dist.TCPStore, workers: list[multiprocessing.process.BaseProcess], name: str) -> None:
    """Until every spawned worker has said it is joining (:func:`_join`). A worker that exits first (an import
    that fails, a GPU it cannot take) is an error at once, naming it, where joining would wait out
    ``COLLECTIVE_TIMEOUT_S`` for it."""
    keys = [f"{JOINING_KEY}{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    while not store.check(keys):  # check, not wait: a wait that times out logs a warning each time
        exited = {rank: w.exitcode for rank, w in enumerate(workers, start=1) if w.exitcode is not None}
        if exited:
            raise RankFailure(f"{name}: rank(s) {exited} (rank: exit code) exited before joining the group; "
                              "the lines they printed above say why")  # fmt: skip
        if time.monotonic() > deadline:
            raise RankFailure(f"{name}: the workers did not start within {COLLECTIVE_TIMEOUT_S:g} s")
        time.sleep(0.05)


def _join(rank: int, world_size: int, address: str, device: torch.device, store: dist.TCPStore | None = None) -> None:
    """Join the process group at ``address``: ``"env://"``, torchrun's environment, or ``"tcp://host:port"``,
    the store rank 0 listens on (rank 0 passes it as ``store``). There a worker says it is joining before it
    joins, so that rank 0 can tell a worker on its way from one that died (:func:`_wait_for_workers`)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if address == "env://":
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout)
        return
    if store is None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
        store.set(f"{JOINING_KEY}{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _kill(workers: list[multiprocessing.process.BaseProcess]) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.kill()
        worker.join()
    if dist.is_initialized():  # so that this process can start another group
        dist.destroy_process_group()


__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "LaunchedRank",
    "ParallelGroup",
    "ParallelRunner",
    "RankFailure",
    "WorkerRunner",
    "check_launch",
    "launched_rank",
    "worker_main",
]

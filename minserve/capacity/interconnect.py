"""The wires between accelerators, and what a collective over them costs (chapter 06).

A link is two numbers: the **bandwidth** one GPU can push into it (bytes/s, per direction) and the
**latency** of one message (seconds, however small the message). Every cost here is the textbook
α–β model: a message of ``S`` bytes takes ``α + S / B``.

A **ring all-reduce** over ``n`` ranks (what NCCL and gloo do for large tensors) cuts the tensor into ``n``
chunks and passes them round the ring twice: ``n − 1`` steps of reduce-scatter, then ``n − 1`` of
all-gather. Each step moves one chunk, ``S / n`` bytes, so

    all-reduce time = 2 (n − 1) / n × S / B  +  2 (n − 1) × α

The bandwidth term barely grows with ``n`` (it tends to ``2 S / B``), but the latency term does: at batch 1
the tensors are a few kilobytes, ``S / B`` is nanoseconds, and the ``2 (n − 1)`` latencies are the whole cost.
That is why tensor parallelism across 8 GPUs speeds up a single stream far less than 8×. Libraries do
better on small messages than this model says (NCCL's low-latency protocols, one-shot all-reduce over
NVSwitch), so read its small-message numbers as an upper bound on the cost.

The table's numbers, each an assumption stated where it is made:

* **NVLink 4** (H100, H200 SXM): 18 links × 50 GB/s = 900 GB/s per GPU in both directions together, so
  450 GB/s each way (NVIDIA's H100 datasheet). **NVLink 3** (A100 SXM): 12 links, 600 GB/s, 300 each way
  (A100 datasheet). A small GPU-to-GPU message over NVLink takes a few microseconds end to end (CUDA's
  ``p2pBandwidthLatencyTest`` reports about 2–3 µs): 3 µs is assumed.
* **PCIe 4.0 / 5.0 x16**: 16 or 32 GT/s × 16 lanes ≈ 32 or 64 GB/s each way, the theoretical rate (real
  transfers reach about 80% of it). About 10 µs a message is assumed (peer-to-peer through a PCIe switch,
  or staged through host memory when peer-to-peer is off).
* **Ethernet 100 / 400 Gb/s** between hosts: 12.5 or 50 GB/s each way. 100G is assumed to carry TCP sockets
  (tens of µs a message in the kernel's network stack: 30 µs), 400G to carry RDMA (RoCE, as GPU fabrics at
  that speed do: 10 µs).
* **this machine**: gloo over the loopback interface between processes on this CPU, *measured* by
  :func:`measure_loopback` (``interconnect("this")``).

Units: ``_bytes``, ``_bytes_per_s``, ``_s`` (seconds).
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GB = 10**9
US = 1e-6


@dataclass(frozen=True)
class Interconnect:
    """One kind of link between accelerators: per-GPU bandwidth each way, per-message latency, and where from."""

    name: str
    bandwidth_bytes_per_s: float  # what one GPU can send while it also receives as much
    latency_s: float  # one message, end to end, however small
    source: str = ""


INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink4": Interconnect(
        "NVLink 4 (H100/H200 SXM)", 450 * GB, 3 * US, "900 GB/s bidirectional per GPU (H100 datasheet); 3 µs assumed"
    ),
    "nvlink3": Interconnect(
        "NVLink 3 (A100 SXM)", 300 * GB, 3 * US, "600 GB/s bidirectional per GPU (A100 datasheet); 3 µs assumed"
    ),
    "pcie5": Interconnect("PCIe 5.0 x16", 64 * GB, 10 * US, "32 GT/s × 16 lanes, theoretical; 10 µs assumed"),
    "pcie4": Interconnect("PCIe 4.0 x16", 32 * GB, 10 * US, "16 GT/s × 16 lanes, theoretical; 10 µs assumed"),
    "ethernet-400g": Interconnect("Ethernet 400 Gb/s", 50 * GB, 10 * US, "400 Gb/s line rate; RDMA (RoCE), 10 µs"),
    "ethernet-100g": Interconnect("Ethernet 100 Gb/s", 12.5 * GB, 30 * US, "100 Gb/s line rate; TCP, 30 µs"),
}
THIS_MACHINE = "this"  # the name interconnect() measures instead of looking up


def interconnect(name: str) -> Interconnect:
    """A table entry by key or full name, any case (``"nvlink4"``, ``"PCIe 4.0 x16"``); ``"this"`` measures
    gloo over loopback here. An unknown name raises ``ValueError`` naming the choices."""
    wanted = name.strip().lower()
    if wanted == THIS_MACHINE:
        return measure_loopback()
    for key, entry in INTERCONNECTS.items():
        if wanted in (key, entry.name.lower()):
            return entry
    raise ValueError(f"unknown interconnect {name!r}; choose one of: {', '.join([*INTERCONNECTS, THIS_MACHINE])}")


# --- what a collective costs ----------------------------------------------------------------------------------


def _check_ranks(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def ring_all_reduce_s(size_bytes: float, world_size: int, link: Interconnect) -> float:
    """Seconds to all-reduce a ``size_bytes`` tensor over ``world_size`` ranks in a ring:
    ``2 (n − 1) / n × S / B + 2 (n − 1) × α``; 0 on one rank (nothing to add)."""
    _check_ranks(world_size)
    steps = 2 * (world_size - 1)
    return steps / world_size * size_bytes / link.bandwidth_bytes_per_s + steps * link.latency_s


def ring_all_gather_s(part_bytes: float, world_size: int, link: Interconnect) -> float:
    """Seconds for every rank to gather every rank's ``part_bytes`` piece: ``n − 1`` ring steps of one piece,
    ``(n − 1) × (S_part / B + α)``; 0 on one rank."""
    _check_ranks(world_size)
    return (world_size - 1) * (part_bytes / link.bandwidth_bytes_per_s + link.latency_s)


def send_s(size_bytes: float, link: Interconnect) -> float:
    """Seconds to send one ``size_bytes`` message to one peer: ``α + S / B`` (a pipeline stage's hand-off)."""
    return link.latency_s + size_bytes / link.bandwidth_bytes_per_s


# --- this machine, measured -----------------------------------------------------------------------------------


def measure_loopback(
    small_bytes: int = 4096, large_bytes: int = 4 * 2**20, repeats: int = 20, world_size: int = 2
) -> Interconnect:
    """Gloo over loopback between ``world_size`` processes on this machine, fitted to the ring model.

    Each rank all-reduces a float32 tensor of ``small_bytes`` and one of ``large_bytes``, ``repeats`` times
    each after a warm-up; the median time of each size gives two points of
    ``t(S) = 2 (n − 1) α + 2 (n − 1) / n × S / B``, which fix α and B. Spawning the ranks takes a few seconds
    (each imports torch); the timing itself well under one. Whatever gloo does inside (it may not use a ring
    for two ranks), the fitted numbers predict the measured sizes exactly and sizes between them closely.
    """
    import torch.multiprocessing as mp  # here, not at the top: the rest of this module is arithmetic

    if not 0 < small_bytes < large_bytes or repeats < 1 or world_size < 2:
        raise ValueError("need 0 < small_bytes < large_bytes, repeats ≥ 1 and world_size ≥ 2")
    with tempfile.TemporaryDirectory(prefix="minserve-loopback-") as scratch:
        out = Path(scratch) / "times.json"
        args = (world_size, str(Path(scratch) / "rendezvous"), str(out), [small_bytes, large_bytes], repeats)
        mp.spawn(_time_all_reduces, args=args, nprocs=world_size)
        small_s, large_s = json.loads(out.read_text())
    steps = 2 * (world_size - 1)
    per_byte_s = max((large_s - small_s) / (large_bytes - small_bytes), 1e-15)  # noise can flatten the line
    bandwidth = steps / world_size / per_byte_s
    latency = max(small_s - steps / world_size * small_bytes / bandwidth, 0.0) / steps
    return Interconnect(
        "this machine (gloo over loopback)",
        bandwidth,
        latency,
        f"measured: median of {repeats} all-reduces of {small_bytes:,} and {large_bytes:,} bytes, {world_size} ranks",
    )


def _time_all_reduces(rank: int, world_size: int, init_file: str, out: str, sizes: list[int], repeats: int) -> None:
    """One rank of :func:`measure_loopback`: the median seconds of an all-reduce at each size (rank 0 writes)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        medians = []
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32)
            dist.all_reduce(tensor)  # warm-up: connections, buffers
            times = []
            for _ in range(repeats):
                dist.barrier()  # start together, so one rank's lateness is not timed as the link's
                start = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        if rank == 0:
            Path(out).write_text(json.dumps(medians))
    finally:
        dist.destroy_process_group()

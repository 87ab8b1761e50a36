"""Chapter 06's link between two processes, measured at several sizes and held to the α–β model.

The α–β model prices a ring all-reduce of ``S`` bytes over ``n`` ranks at ``2 (n − 1) α + 2 (n − 1) / n × S / B``
(:func:`minserve.capacity.interconnect.ring_all_reduce_s`). Two sizes fix its two numbers; a model is only
worth its fit if it also predicts the sizes it was *not* fitted on. So :func:`measure_link_sizes` times
all-reduces at four sizes over gloo, :func:`fit_ring` fits α and B on the smallest and the largest, and
:func:`link_table` lays the prediction beside every measurement, the two in between held out.

Units: bytes, seconds (the table shows µs).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from minserve.capacity.interconnect import Interconnect, _time_all_reduces, ring_all_reduce_s

# 4 KB (a decode step's activations: the latency term), 4 MB (the bandwidth term) and two held out between.
DEFAULT_SIZES = (4096, 65536, 524288, 4 * 2**20)


@dataclass(frozen=True)
class LinkMeasurement:
    """Median seconds of one all-reduce at each size, over ``world_size`` ranks."""

    sizes_bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    world_size: int = 2


def measure_link_sizes(
    sizes_bytes: Sequence[int] = DEFAULT_SIZES, repeats: int = 50, world_size: int = 2
) -> LinkMeasurement:
    """All-reduces of float32 tensors of ``sizes_bytes`` between ``world_size`` spawned processes over gloo
    (one torch thread each), the median of ``repeats`` at each size after a warm-up. Spawning costs a few
    seconds (each process imports torch); the timing itself well under one."""
    import torch.multiprocessing as mp  # here: the rest of this module is arithmetic

    sizes = sorted(int(s) for s in sizes_bytes)
    if len(sizes) < 3 or sizes[0] <= 0 or repeats < 1 or world_size < 2:
        raise ValueError("need at least three positive sizes (two to fit, one to hold out), repeats ≥ 1, 2+ ranks")
    with tempfile.TemporaryDirectory(prefix="minserve-link-") as scratch:
        out = Path(scratch) / "times.json"
        args = (world_size, str(Path(scratch) / "rendezvous"), str(out), sizes, repeats)
        mp.spawn(_time_all_reduces, args=args, nprocs=world_size)
        seconds = json.loads(out.read_text())
    return LinkMeasurement(tuple(sizes), tuple(seconds), world_size)


def fit_ring(measured: LinkMeasurement) -> Interconnect:
    """α and B of the ring model through the smallest and the largest size's times (two points, two
    unknowns). A flat or falling line (noise) gives B = ∞ rather than a negative bandwidth."""
    (s0, s1), (t0, t1) = (
        (measured.sizes_bytes[0], measured.sizes_bytes[-1]),
        (measured.seconds[0], measured.seconds[-1]),
    )
    n = measured.world_size
    steps = 2 * (n - 1)
    per_byte_s = max((t1 - t0) / (s1 - s0), 1e-15)
    bandwidth = steps / n / per_byte_s
    latency = max(t0 - steps / n * s0 / bandwidth, 0.0) / steps
    return Interconnect("this machine (gloo over loopback)", bandwidth, latency,
                        f"fitted on {s0:,} and {s1:,} bytes, {n} ranks")  # fmt: skip


def link_table(measured: LinkMeasurement, link: Interconnect) -> pd.DataFrame:
    """One row per size: measured and predicted µs, their ratio, and whether the size was fitted on (the
    smallest and the largest) or held out."""
    last = len(measured.sizes_bytes) - 1
    rows = []
    for i, (size, seconds) in enumerate(zip(measured.sizes_bytes, measured.seconds)):
        predicted = ring_all_reduce_s(size, measured.world_size, link)
        rows.append({
            "bytes": size,
            "role": "fitted" if i in (0, last) else "held out",
            "measured µs": seconds * 1e6,
            "predicted µs": predicted * 1e6,
            "predicted / measured": predicted / seconds,
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("bytes")

"""``minserve.serve.launch``'s process helpers that need no server: the resident-memory sampler."""

from __future__ import annotations

import mmap
import os
import time

import pytest

from minserve.serve.launch import MemorySampler, engine_core_pid, resident_bytes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
CHUNK = 64 * 2**20


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_sampler_sees_memory_grow_and_fall_in_order():
    with MemorySampler({"self": os.getpid()}, every_s=0.01) as memory:
        samples = memory.samples["self"]
        _until(lambda: len(samples) >= 2)
        before = samples[-1][1]
        held = mmap.mmap(-1, CHUNK)  # fresh pages of its own, whatever the allocator holds already
        for offset in range(0, CHUNK, mmap.PAGESIZE):
            held[offset] = 1  # written, so resident
        _until(lambda: samples[-1][1] - before > 0.9 * CHUNK)
        held.close()  # unmapped: resident no more
        _until(lambda: samples[-1][1] - before < 0.5 * CHUNK)
    times = [t for t, _ in samples]
    assert times == sorted(times)
    summary = memory.summary()["self"]
    assert summary["max"] - summary["first"] > 0.9 * CHUNK
    assert summary["max"] - summary["last"] > 0.5 * CHUNK  # it reads memory now, not a high-water mark


def test_a_process_without_an_engine_core_has_none_and_a_gone_one_reads_zero():
    assert engine_core_pid(os.getpid()) == 0
    assert resident_bytes(2**22 + 12345) == 0  # above any pid Linux hands out by default

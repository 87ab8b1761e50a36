"""``minserve.serve.launch``'s process helpers that need no server: the resident-memory sampler."""

from __future__ import annotations

import os
import time

import pytest

from minserve.serve.launch import MemorySampler, engine_core_pid, resident_bytes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")


def test_sampler_sees_memory_grow_and_fall_in_order():
    chunk = 64 * 2**20
    with MemorySampler({"self": os.getpid()}, every_s=0.02) as memory:
        time.sleep(0.1)
        held = bytearray(chunk)  # written, so resident
        held[::4096] = b"\x01" * len(held[::4096])
        time.sleep(0.1)
        del held
        time.sleep(0.1)
    samples = memory.samples["self"]
    times = [t for t, _ in samples]
    assert times == sorted(times) and times[0] < 0.02 and len(samples) >= 5
    summary = memory.summary()["self"]
    assert summary["max"] - summary["first"] > 0.9 * chunk
    assert summary["max"] - summary["last"] > 0.9 * chunk  # freed: the sampler reads now, not a high-water mark


def test_a_process_without_an_engine_core_has_none_and_a_gone_one_reads_zero():
    assert engine_core_pid(os.getpid()) == 0
    assert resident_bytes(2**22 + 12345) == 0  # above any pid Linux hands out by default

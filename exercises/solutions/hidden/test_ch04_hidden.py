"""Chapter 04's hidden tests (``minserve grade ch04 --hidden``): the public tests' measures on other models,
larger caches and blocks, longer prompts and another eviction order, so an allocator fitted to the public
tests' small cases does not pass these. Instructors only: this file sits under ``exercises/solutions/``,
which the learner's copy of the course never holds.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.capacity import kv_bytes_per_token_preset, model_preset

PROPERTY = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["Qwen3-8B", "Mixtral-8x7B", "Qwen3-30B-A3B", "Llama-2-70B"])
def test_kv_bytes_of_other_models(exercise, name):
    """Grouped-query and mixture-of-experts models, 16-bit and 32-bit: minserve's own count."""
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        assert exercise.kv_bytes_per_token(model_preset(name), size) == kv_bytes_per_token_preset(name, dtype)


def _start(exercise, allocator, prompt):
    """A scheduler's start of a prompt: share the cached prefix, allocate and commit the rest. None: no room
    (everything taken is handed back)."""
    size = allocator.block_size
    blocks, parent = allocator.lookup(prompt), None
    for i in range(len(blocks)):
        parent = exercise.block_hash(parent, prompt[i * size : (i + 1) * size])
    for start in range(len(blocks) * size, len(prompt), size):
        try:
            block = allocator.allocate()
        except exercise.OutOfBlocks:
            for b in blocks:
                allocator.free(b)
            return None
        blocks.append(block)
        if len(prompt[start : start + size]) == size:
            parent = allocator.commit(block, parent, prompt[start : start + size])
    return blocks


@pytest.mark.points(4)
@PROPERTY
@given(
    num_blocks=st.integers(4, 32),
    block_size=st.sampled_from([4, 8, 16]),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("start"), st.lists(st.integers(0, 3), min_size=1, max_size=40)),
            st.tuples(st.just("finish"), st.integers(0, 100)),
        ),
        max_size=50,
    ),
)
def test_larger_caches_and_blocks_keep_every_invariant(exercise, num_blocks, block_size, ops):
    """Larger caches, blocks of 4–16 tokens, prompts up to 40 tokens from 4 symbols (many shared prefixes):
    refcounts equal holders, num_free adds up, a running prompt's full blocks are found, nothing leaks."""
    allocator = exercise.BlockAllocator(num_blocks, block_size)
    running: list[tuple[list[int], list[int]]] = []
    for op, arg in ops:
        if op == "start":
            for other_prompt, other_blocks in running:
                common = 0
                while (common + 1) * block_size <= min(len(arg), len(other_prompt)) and (
                    other_prompt[: (common + 1) * block_size] == arg[: (common + 1) * block_size]
                ):
                    common += 1
                found = allocator.lookup(arg)
                assert found[:common] == other_blocks[:common], "a running prompt's cached prefix was not found"
                for block in found:
                    allocator.free(block)
            blocks = _start(exercise, allocator, arg)
            if blocks is not None:
                running.append((arg, blocks))
        elif running:
            for block in running.pop(arg % len(running))[1]:
                allocator.free(block)
        holders = Counter(b for _, blocks in running for b in blocks)
        assert [allocator.refcount(b) for b in range(num_blocks)] == [holders[b] for b in range(num_blocks)]
        assert allocator.num_free == num_blocks - len(holders)
    for _, blocks in running:
        for block in blocks:
            allocator.free(block)
    assert allocator.num_free == num_blocks and all(allocator.refcount(b) == 0 for b in range(num_blocks))


@pytest.mark.points(2)
def test_eviction_follows_the_order_blocks_were_last_used(exercise):
    """Five cached one-block prompts freed in the order 3, 0, 4, 1, 2, one of them (0) found again before
    the evictions: blocks go in the order 3, 4, 1, 2, and the found one is never taken."""
    allocator = exercise.BlockAllocator(num_blocks=5, block_size=3)
    prompts = [[i, i + 10, i + 20] for i in range(5)]
    blocks = [_start(exercise, allocator, p)[0] for p in prompts]
    for i in (3, 0, 4, 1, 2):
        allocator.free(blocks[i])
    assert allocator.lookup(prompts[0]) == [blocks[0]]
    assert [allocator.allocate() for _ in range(4)] == [blocks[i] for i in (3, 4, 1, 2)]
    with pytest.raises(exercise.OutOfBlocks):
        allocator.allocate()

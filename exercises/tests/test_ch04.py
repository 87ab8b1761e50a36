"""Graded tests for chapter 04 (``minserve grade ch04``). Each test's docstring is the hint a learner sees.

The byte counts are the published ones (computed here from the preset configs in ``minserve.capacity``);
the allocator is checked on hand-made scenarios and then by hypothesis, which runs random sequences of
sequences starting (look up a cached prefix, allocate the rest) and finishing (free every block) against a
model of who holds what.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.capacity import model_preset
from minserve.model.loader import ASSETS_DIR

PROPERTY = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


# --- part 1: bytes per token -------------------------------------------------------------------------------


@pytest.mark.points(1)
@pytest.mark.parametrize(
    ("name", "expected"),
    [("Llama-2-7B", 524_288), ("Llama-2-13B", 819_200), ("Llama-3-8B", 131_072), ("Llama-3-70B", 327_680)],
)
def test_kv_bytes_per_token_published(exercise, name, expected):
    """2 × layers × KV heads × head_dim × dtype bytes: Llama-2-7B in 16-bit is 2 × 32 × 32 × 128 × 2 = 524,288."""
    assert exercise.kv_bytes_per_token(model_preset(name), 2) == expected


@pytest.mark.points(2)
def test_kv_bytes_per_token_defaults(exercise):
    """Use num_key_value_heads (GQA), default it to num_attention_heads, and prefer an explicit head_dim."""
    mha = {k: v for k, v in model_preset("Llama-2-7B").items() if k != "num_key_value_heads"}
    assert exercise.kv_bytes_per_token(mha, 2) == 524_288
    assert exercise.kv_bytes_per_token(model_preset("Mistral-7B"), 1) == 65_536  # fp8 halves it
    # Qwen3-0.6B: head_dim is 128, not hidden_size / heads = 64.
    assert exercise.kv_bytes_per_token(model_preset("Qwen3-0.6B"), 2) == 2 * 28 * 8 * 128 * 2


@pytest.mark.points(1)
def test_kv_bytes_per_token_of_the_embedded_model(exercise):
    """The embedded model's config.json: 4 layers, 2 KV heads, head_dim 64 → 2 × 4 × 2 × 64 × 2 bytes."""
    config = json.loads((ASSETS_DIR / "minserve-tiny" / "config.json").read_text())
    assert exercise.kv_bytes_per_token(config, 2) == 2048


# --- part 2: the allocator ---------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_block_hash_chains_the_parent(exercise):
    """A block's hash depends on its tokens and on its parent's hash: same tokens after another prefix differ."""
    a = exercise.block_hash(None, [1, 2, 3, 4])
    assert a == exercise.block_hash(None, (1, 2, 3, 4)) and isinstance(a, int)
    assert exercise.block_hash(a, [5, 6, 7, 8]) == exercise.block_hash(a, [5, 6, 7, 8])
    assert exercise.block_hash(a, [5, 6, 7, 8]) != exercise.block_hash(None, [5, 6, 7, 8])
    assert exercise.block_hash(None, [1, 2, 3, 4]) != exercise.block_hash(None, [4, 3, 2, 1])


@pytest.mark.points(2)
def test_allocate_and_free(exercise):
    """allocate() gives distinct blocks with refcount 1 and lowers num_free; free() gives them back."""
    allocator = exercise.BlockAllocator(num_blocks=4, block_size=16)
    assert allocator.num_free == 4
    blocks = [allocator.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and allocator.num_free == 0
    assert all(allocator.refcount(b) == 1 for b in blocks)
    with pytest.raises(exercise.OutOfBlocks):
        allocator.allocate()
    allocator.free(blocks[2])
    assert allocator.num_free == 1 and allocator.refcount(blocks[2]) == 0
    assert allocator.allocate() == blocks[2]


@pytest.mark.points(1)
def test_double_free_is_an_error(exercise):
    """Freeing a block whose refcount is already 0 is a bug in the caller: raise ValueError, change nothing."""
    allocator = exercise.BlockAllocator(num_blocks=2, block_size=4)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError):
        allocator.free(block)
    assert allocator.num_free == 2 and allocator.refcount(block) == 0


@pytest.mark.points(1)
def test_commit_needs_a_full_block(exercise):
    """Only a full block (exactly block_size tokens) can be committed; commit() returns its block_hash."""
    allocator = exercise.BlockAllocator(num_blocks=2, block_size=4)
    block = allocator.allocate()
    with pytest.raises(ValueError):
        allocator.commit(block, None, [1, 2, 3])
    assert allocator.commit(block, None, [1, 2, 3, 4]) == exercise.block_hash(None, [1, 2, 3, 4])


def _start(allocator, exercise, prompt):
    """What a scheduler does for a new prompt: share the cached prefix, allocate (and commit) the rest."""
    blocks = allocator.lookup(prompt)
    parent = None
    for i in range(len(blocks)):
        parent = exercise.block_hash(parent, prompt[i * allocator.block_size : (i + 1) * allocator.block_size])
    for start in range(len(blocks) * allocator.block_size, len(prompt), allocator.block_size):
        block = allocator.allocate()
        blocks.append(block)
        chunk = prompt[start : start + allocator.block_size]
        if len(chunk) == allocator.block_size:
            parent = allocator.commit(block, parent, chunk)
    return blocks


@pytest.mark.points(3)
def test_a_shared_prefix_is_found(exercise):
    """lookup() chains the hashes over the prompt's full blocks and shares every cached one (refcount + 1)."""
    allocator = exercise.BlockAllocator(num_blocks=16, block_size=4)
    system = _tokens(1, 8)  # two full blocks of system prompt
    a = _start(allocator, exercise, [*system, 50, 51, 52, 53, 54])  # 3 full blocks + 1 partial
    assert len(a) == 4 and allocator.num_free == 12
    shared = allocator.lookup([*system, 60, 61, 62, 63])
    assert shared == a[:2]
    assert [allocator.refcount(b) for b in a] == [2, 2, 1, 1]
    assert allocator.num_free == 12  # sharing takes no new block
    assert allocator.lookup([*system, 50, 51, 52]) == a[:2]  # a partial block is never shared
    assert allocator.lookup(_tokens(2, 8)) == []


@pytest.mark.points(1)
def test_equal_blocks_after_different_prefixes_are_not_shared(exercise):
    """A block is found only with its whole prefix: the hash of block 2 includes the hash of block 1."""
    allocator = exercise.BlockAllocator(num_blocks=8, block_size=2)
    _start(allocator, exercise, [1, 2, 3, 4])
    assert allocator.lookup([9, 9, 3, 4]) == []
    assert len(allocator.lookup([1, 2, 3, 4])) == 2


@pytest.mark.points(2)
def test_freed_full_blocks_stay_cached(exercise):
    """At refcount 0 a committed block counts as free but stays findable; allocate() takes never-cached blocks first."""
    allocator = exercise.BlockAllocator(num_blocks=8, block_size=4)
    prompt = _tokens(3, 10)  # 2 full blocks + a partial one
    blocks = _start(allocator, exercise, prompt)
    for block in blocks:
        allocator.free(block)
    assert allocator.num_free == 8
    fresh = [allocator.allocate() for _ in range(6)]  # 6 never-cached blocks are left: no eviction needed yet
    assert not set(fresh) & set(blocks[:2])
    again = allocator.lookup(prompt)
    assert again == blocks[:2] and [allocator.refcount(b) for b in again] == [1, 1]
    assert allocator.num_free == 0


@pytest.mark.points(3)
def test_eviction_is_lru_and_spares_referenced_blocks(exercise):
    """With no never-cached block left, evict the least recently freed unreferenced cached block, never a held one."""
    allocator = exercise.BlockAllocator(num_blocks=3, block_size=2)
    prompts = [[10, 11], [20, 21], [30, 31]]
    blocks = [_start(allocator, exercise, p)[0] for p in prompts]
    for i in (1, 0, 2):  # block 1 becomes unreferenced first: it is the least recently used
        allocator.free(blocks[i])
    assert allocator.allocate() == blocks[1]
    assert allocator.lookup(prompts[1]) == []  # evicted: its prefix is forgotten
    assert allocator.lookup(prompts[0]) == [blocks[0]]  # found, so referenced again: not evictable now
    assert allocator.allocate() == blocks[2]
    assert allocator.num_free == 0
    with pytest.raises(exercise.OutOfBlocks):
        allocator.allocate()
    assert allocator.refcount(blocks[0]) == 1


operations = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.lists(st.integers(0, 2), max_size=9)),
        st.tuples(st.just("finish"), st.integers(0, 100)),
    ),
    max_size=40,
)


@pytest.mark.points(5)
@PROPERTY
@given(num_blocks=st.integers(1, 8), block_size=st.sampled_from([1, 2, 3]), ops=operations)
def test_random_workloads_keep_every_invariant(exercise, num_blocks, block_size, ops):
    """Random starts and finishes: refcounts equal holders, num_free adds up, no leak, no double allocation."""
    allocator = exercise.BlockAllocator(num_blocks, block_size)
    running: list[tuple[list[int], list[int]]] = []  # (prompt, blocks held) per running sequence
    for op, arg in ops:
        holders = Counter(b for _, blocks in running for b in blocks)
        if op == "start":
            _check_start(exercise, allocator, running, holders, arg)
        elif running:
            _, blocks = running.pop(arg % len(running))
            for block in blocks:
                allocator.free(block)
            gone = [b for b in blocks if b not in Counter(b for _, bs in running for b in bs)]
            if gone:  # a second free of a block nobody holds any more is a double free
                with pytest.raises(ValueError):
                    allocator.free(gone[0])
        holders = Counter(b for _, blocks in running for b in blocks)
        assert [allocator.refcount(b) for b in range(num_blocks)] == [holders[b] for b in range(num_blocks)]
        assert allocator.num_free == num_blocks - len(holders)
    for _, blocks in running:  # everything finishes: every block is free again
        for block in blocks:
            allocator.free(block)
    assert allocator.num_free == num_blocks
    assert all(allocator.refcount(b) == 0 for b in range(num_blocks))


def _check_start(exercise, allocator, running, holders, prompt):
    size = allocator.block_size
    full_blocks = len(prompt) // size
    shared = allocator.lookup(prompt)
    assert len(shared) <= full_blocks and len(set(shared)) == len(shared)
    for other_prompt, other_blocks in running:  # a running sequence's full blocks are cached: they must be found
        common = 0
        while common < full_blocks and other_prompt[: (common + 1) * size] == prompt[: (common + 1) * size]:
            common += 1
        common = min(common, len(other_prompt) // size)
        assert len(shared) >= common
        assert shared[:common] == other_blocks[:common]
    blocks, parent = list(shared), None
    for i in range(len(shared)):
        parent = exercise.block_hash(parent, prompt[i * size : (i + 1) * size])
    for start in range(len(shared) * size, len(prompt), size):
        free_before = allocator.num_free
        try:
            block = allocator.allocate()
        except exercise.OutOfBlocks:
            assert free_before == 0, "OutOfBlocks although num_free > 0"
            for b in blocks:  # not admitted: hand everything back
                allocator.free(b)
            return
        assert holders[block] == 0 and block not in blocks, f"block {block} was handed out while held"
        blocks.append(block)
        chunk = prompt[start : start + size]
        if len(chunk) == size:
            parent = allocator.commit(block, parent, chunk)
    running.append((prompt, blocks))

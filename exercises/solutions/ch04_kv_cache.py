"""Chapter 04 exercise, reference solutions (instructors: ``minserve grade ch04 --solutions``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """KV-cache bytes per token: 2 × num_hidden_layers × num_key_value_heads × head_dim × dtype_bytes."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads  # absent: multi-head attention
    head_dim = config.get("head_dim") or config["hidden_size"] // heads  # absent: hidden split over heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The hash of a full block: of its parent block's hash and its own tokens, so it names the whole prefix."""
    return hash((parent_hash, tuple(token_ids)))


class OutOfBlocks(Exception):
    """allocate() found no free block and no unreferenced cached block to evict."""


class BlockAllocator:
    """Hands out KV-cache blocks with reference counts, and keeps full blocks cached by prefix hash."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # never cached; pop() hands out 0, 1, 2, …
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self.hash_to_block: dict[int, int] = {}
        self.block_to_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out now: free ones plus unreferenced cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    def refcount(self, block_id: int) -> int:
        """How many holders share the block."""
        return self.ref_counts[block_id]

    def allocate(self) -> int:
        """A block for one holder (refcount 1): a free one if any, else evict the least recently used."""
        if self.free_blocks:
            block_id = self.free_blocks.pop()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            del self.hash_to_block[self.block_to_hash.pop(block_id)]  # its prefix can no longer be found
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """One holder lets go. At refcount 0 a cached block stays findable (and evictable); others are free."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated (double free?)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if block_id in self.block_to_hash:
                self.evictable[block_id] = None  # appended: the most recently used
            else:
                self.free_blocks.append(block_id)

    def commit(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Record that a held block is full with ``token_ids``; returns its hash for the next block's parent."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a full block holds {self.block_size} tokens, got {len(token_ids)}")
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        h = block_hash(parent_hash, token_ids)
        if h not in self.hash_to_block and block_id not in self.block_to_hash:  # the first copy stays the cached one
            self.hash_to_block[h] = block_id
            self.block_to_hash[block_id] = h
        return h

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Share the cached blocks of the longest cached prefix of ``token_ids`` (full blocks only)."""
        shared: list[int] = []
        parent: int | None = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = block_hash(parent, token_ids[start : start + self.block_size])
            block_id = self.hash_to_block.get(parent)
            if block_id is None:
                break
            self.evictable.pop(block_id, None)  # referenced again: not evictable
            self.ref_counts[block_id] += 1
            shared.append(block_id)
        return shared

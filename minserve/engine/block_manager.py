"""The block manager owns KV memory: which physical block holds which tokens of which sequence.

The cache is cut into ``num_blocks`` blocks of ``block_size`` token slots. A sequence holds a *block table*,
the list of its blocks in order, and grows it one block at a time, so it never reserves memory for tokens it
has not produced (paging; at most one partly filled block per sequence is wasted).

**Prefix caching.** A full block is named by a hash chain: ``hash(parent block's hash, its tokens)``, so the
name stands for the whole prefix up to and including that block. When a new request arrives, its prompt's
full blocks are looked up by name; every hit is shared (its reference count goes up) and its tokens need no
compute. When a sequence finishes, its blocks' counts go down; a block at zero goes back to the free queue
but keeps its name and contents, so a later request with the same prefix still finds it. Only when a free
block is handed out again is its old name forgotten; the free queue is in least-recently-freed order, so
that is LRU eviction.

Invariants (``check_invariants`` asserts them; the tests call it after random workloads):
a block's ``ref_count`` is the number of live sequences whose table holds it, and no table holds a block
twice; the free queue holds exactly the blocks at count zero, once each; only named (full, hashed) blocks
are ever shared, at the same position in every table; every named block is registered under its name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from minserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and named
    token_ids: tuple[int, ...] = field(default_factory=tuple)  # the tokens of a named block


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when the free queue is empty; the scheduler avoids it by asking first."""


class BlockManager:
    """Paged KV memory with reference counts, prefix hashing and LRU reuse of freed blocks."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_cpu_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first. An OrderedDict gives O(1) removal of a block that a
        # prefix hit revives from the middle of the queue.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Host memory for swapped-out sequences: plain blocks, never shared or named; free ones in a set.
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: set[int] = set(range(num_cpu_blocks))
        self.prefix_queries_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits_tokens = 0  # of those, tokens found

    # --- capacity ---------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """More blocks ``seq`` needs so that ``num_computed_tokens + num_new_tokens`` tokens fit."""
        total_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # --- prefix cache -----------------------------------------------------------------------------------

    def hash_block(self, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids))

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks already holding the longest cached prefix of ``token_ids`` (full blocks only).

        The last token is never taken from the cache: its logits are needed to sample the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        num_full_blocks = (len(token_ids) - 1) // self.block_size
        for index in range(num_full_blocks):
            chunk = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = self.hash_block(parent, chunk)
            block_id = self.hash_to_block.get(parent)
            # A hash names a prefix; comparing the tokens too makes a hash collision harmless.
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def share_cached_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give an admitted sequence the cached blocks of its prefix; their tokens count as computed.

        The hit statistics (and ``seq.num_cached_tokens``) describe the prompt at first admission only: a
        preempted sequence coming back finds its own output blocks too, which is recompute saved, not
        prompt reuse.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in block_ids:
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries_tokens += len(seq.prompt_token_ids)
            self.prefix_hits_tokens += seq.num_cached_tokens

    def name_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks of ``seq`` that its computed tokens have filled since the last call.

        ``seq.block_hashes`` keeps the hash chain of its full blocks: it depends only on the tokens, so it
        stays valid across a preemption.
        """
        if not self.enable_prefix_caching:
            return
        tokens = seq.token_ids  # computed tokens can run ahead of it for a moment: accepted drafts
        for index in range(len(seq.block_hashes), min(seq.num_computed_tokens, len(tokens)) // self.block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            block_hash = self.hash_block(parent, chunk)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and block_hash not in self.hash_to_block:  # else: already known
                block.block_hash, block.token_ids = block_hash, chunk
                self.hash_to_block[block_hash] = block.block_id

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens whose KV came from the cache (0 when nothing was looked up)."""
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    # --- allocate and free ------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens. Ask ``can_allocate`` first."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            block_id = next(iter(self.free_queue))  # least recently freed: the LRU victim
            self._forget_name(self.blocks[block_id])
            self._take(block_id)
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks. Named blocks stay findable until their slot is handed out again."""
        # Tail blocks first into the queue, so a shared prefix (the head) is the last to be evicted.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def forget_own_blocks(self, seq: Sequence) -> list[int]:
        """The blocks only ``seq`` holds, their names forgotten: call before freeing a request whose KV
        cannot be trusted (it failed, perhaps on NaN). No later request finds them in the prefix cache, and
        the caller may clear them; blocks shared with another sequence hold the same tokens' KV for it."""
        own = [block_id for block_id in seq.block_table if self.blocks[block_id].ref_count == 1]
        for block_id in own:
            self._forget_name(self.blocks[block_id])
        return own

    # --- swapping to host memory -------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s KV to host blocks: returns the (device block, host block) copies to make *before* the
        device blocks are written again. Its device blocks are released as by :meth:`free` (a shared prefix
        block stays with its other holders); its computed tokens stay computed."""
        host = [self.free_cpu_blocks.pop() for _ in seq.block_table]
        copies = list(zip(seq.block_table, host))
        computed = seq.num_computed_tokens
        self.free(seq)
        seq.cpu_block_table, seq.num_computed_tokens = host, computed
        return copies

    def can_swap_in(self, seq: Sequence) -> bool:
        return len(seq.cpu_block_table) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back into fresh device blocks: returns the (host, device) copies."""
        device = []
        for _ in seq.cpu_block_table:
            block_id = next(iter(self.free_queue))
            self._forget_name(self.blocks[block_id])
            self._take(block_id)
            device.append(block_id)
        copies = list(zip(seq.cpu_block_table, device))
        self.free_cpu_blocks.update(seq.cpu_block_table)
        seq.cpu_block_table, seq.block_table = [], device
        seq.block_hashes = []  # the fresh blocks hold the same tokens: name them again, as at first
        return copies

    def free_swapped(self, seq: Sequence) -> None:
        """Release the host blocks of a swapped-out sequence that finished or was cancelled there."""
        self.free_cpu_blocks.update(seq.cpu_block_table)
        seq.cpu_block_table = []
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _forget_name(self, block: Block) -> None:
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block.block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    # --- invariants -------------------------------------------------------------------------------------

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise ``AssertionError`` unless the accounting is exact: no block leaked, double-owned or lost.

        ``live`` is every sequence not yet finished (waiting ones hold no blocks). Checked:

        - every block id in a table is a real block, and no table holds the same block twice;
        - a block's ``ref_count`` is the number of tables that hold it, and it is in the free queue
          exactly when that number is zero;
        - only a named block is shared (``ref_count > 1``): sharing happens only through a prefix-cache hit.
          A shared block sits at the same index in every holder's table (its name is the hash chain of
          the whole prefix up to it, so it can stand at one position only);
        - a named block is full, registered under its name (and the name only under it), and holds
          the tokens that each holder has at that position;
        - with prefix caching off, nothing is named;
        - each host block is held by at most one swapped-out sequence, or free, never both nor neither.

        It raises explicitly rather than with ``assert`` statements, so it also checks under ``python -O``.
        """
        positions: list[list[tuple[Sequence, int]]] = [[] for _ in range(self.num_blocks)]
        for seq in live:
            _require(
                len(set(seq.block_table)) == len(seq.block_table),
                f"request {seq.request_id}: a block appears twice in its table {seq.block_table}",
            )
            for index, block_id in enumerate(seq.block_table):
                _require(0 <= block_id < self.num_blocks, f"request {seq.request_id}: no block {block_id}")
                positions[block_id].append((seq, index))
        for block in self.blocks:
            holders = positions[block.block_id]
            where = f"block {block.block_id}"
            _require(
                block.ref_count == len(holders),
                f"{where}: ref_count {block.ref_count} but held by {len(holders)} table entries",
            )
            _require(
                (block.ref_count == 0) == (block.block_id in self.free_queue),
                f"{where}: ref_count {block.ref_count} but {'in' if block.block_id in self.free_queue else 'not in'} "
                "the free queue",
            )
            if len(holders) > 1:
                _require(
                    block.block_hash is not None,
                    f"{where}: unnamed but shared by requests {[seq.request_id for seq, _ in holders]}",
                )
                _require(
                    len({index for _, index in holders}) == 1,
                    f"{where}: shared at different positions {[(seq.request_id, i) for seq, i in holders]}",
                )
            if block.block_hash is not None:
                _require(self.enable_prefix_caching, f"{where}: named while prefix caching is off")
                _require(len(block.token_ids) == self.block_size, f"{where}: named but not full")
                _require(self.hash_to_block.get(block.block_hash) == block.block_id, f"{where}: name not registered")
                for seq, index in holders:
                    tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
                    _require(
                        tokens == block.token_ids,
                        f"{where}: holds other tokens than request {seq.request_id} has at block {index}",
                    )
        host_held = [block_id for seq in live for block_id in seq.cpu_block_table]
        _require(len(host_held) == len(set(host_held)), "a host block is held twice")
        _require(not set(host_held) & self.free_cpu_blocks, "a held host block is also free")
        _require(
            len(host_held) + len(self.free_cpu_blocks) == self.num_cpu_blocks,
            f"host blocks: {len(host_held)} held + {len(self.free_cpu_blocks)} free ≠ {self.num_cpu_blocks}",
        )
        num_unheld = sum(1 for block in self.blocks if block.ref_count == 0)
        _require(len(self.free_queue) == num_unheld, f"free queue holds {len(self.free_queue)}, not {num_unheld}")
        for block_hash, block_id in self.hash_to_block.items():
            _require(
                0 <= block_id < self.num_blocks and self.blocks[block_id].block_hash == block_hash,
                f"name {block_hash} points at block {block_id}, which does not carry it",
            )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)

"""Chapter 04 exercise: KV-cache bytes, and a block allocator with reference counts and prefix caching.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch04

Part 1 is the arithmetic: how many bytes one token keeps in the KV cache, from a Hugging Face
``config.json`` dict.

Part 2 is the memory manager of a paged KV cache. The cache is ``num_blocks`` blocks of ``block_size``
token slots each, named by ids 0 … num_blocks − 1 (the allocator only does the bookkeeping; no tensors).

- A *holder* (a running sequence) gets a block from ``allocate()``; the block's reference count is the
  number of holders sharing it. ``free(block_id)`` is one holder letting go.
- A block filled with exactly ``block_size`` tokens is *committed*: its hash chains its parent block's
  hash with its tokens, so equal hashes mean equal whole prefixes, not just equal blocks.
- ``lookup(token_ids)`` finds the cached blocks of the longest prefix of a new prompt and shares them
  (refcount + 1): a shared system prompt is computed once.
- A committed block whose refcount drops to 0 stays cached, so a later prompt can still reuse it, but it
  counts as free: when no never-cached block is left, ``allocate()`` evicts the unreferenced cached block
  that was least recently used and forgets its hash.

Use only the standard library: the grader refuses a file that imports anything else, minserve's own block
manager included. How you keep the state (which blocks are free, which are cached, in what order they
were last used) is yours; the tests check the behaviour above, on hand-made cases and by hypothesis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """KV-cache bytes one token occupies: 2 (K and V) × num_hidden_layers × num_key_value_heads × head_dim × bytes.

    ``config`` is a Hugging Face ``config.json`` dict. Without ``num_key_value_heads`` the model uses full
    multi-head attention (one KV head per query head, ``num_attention_heads``); without ``head_dim`` it is
    ``hidden_size // num_attention_heads``. ``dtype_bytes`` is 2 for bf16/fp16, 1 for fp8.
    """
    raise NotImplementedError


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The hash of a full block from its parent's hash (``None`` for the first block) and its token ids.

    Deterministic (the same inputs, as a list or a tuple, give the same hash), and different when the tokens
    or the parent differ, so that equal hashes name equal whole prefixes, not just equal blocks.
    """
    raise NotImplementedError


class OutOfBlocks(Exception):
    """allocate() found no free block and no unreferenced cached block to evict. (Given: nothing to write.)"""


class BlockAllocator:
    """Hands out KV-cache blocks with reference counts, and keeps full blocks cached by prefix hash.

    Invariants the tests check after every operation:

    - ``refcount(b)`` equals the number of holders of block ``b``;
    - ``num_free == num_blocks − (blocks with refcount > 0)``;
    - ``allocate()`` never returns a block someone holds, and raises ``OutOfBlocks`` only when
      ``num_free == 0``;
    - ``free`` of a block with refcount 0 raises ``ValueError`` (a double free), and changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per block
        raise NotImplementedError  # the state your design needs

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out now: never-cached free blocks plus unreferenced cached ones."""
        raise NotImplementedError

    def refcount(self, block_id: int) -> int:
        """How many holders share the block (0 when it is free or only cached)."""
        raise NotImplementedError

    def allocate(self) -> int:
        """A block for one new holder, with refcount 1.

        Take a never-cached free block if there is one; otherwise evict the least recently used
        unreferenced cached block (forget its hash, so lookup no longer finds it). Raise ``OutOfBlocks``
        when every block is referenced.
        """
        raise NotImplementedError

    def free(self, block_id: int) -> None:
        """One holder lets go of the block: refcount − 1.

        At refcount 0 a committed block stays cached (lookup still finds it) and becomes the most recently
        used evictable block; an uncommitted block goes back to the free blocks. A block with refcount 0
        already is a double free: raise ``ValueError``.
        """
        raise NotImplementedError

    def commit(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Record that a held block is full with ``token_ids``; return its :func:`block_hash`.

        ``ValueError`` unless ``len(token_ids) == block_size``. If another block already caches the same
        hash, keep that one (this block stays uncached). The returned hash is the next block's parent.
        """
        raise NotImplementedError

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Share the cached blocks of the longest cached prefix of ``token_ids``; return their ids in order.

        Only full blocks are cached (a partial last block never is), and a block is found only with its
        whole prefix: the result is the cached blocks of the first 0, 1, 2, … full blocks of ``token_ids``,
        as far as they go. Each block found gains a holder (refcount + 1) and is no longer evictable.
        """
        raise NotImplementedError

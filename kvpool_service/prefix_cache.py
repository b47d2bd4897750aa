"""The prefix cache: full blocks named by a hash chain, and the LRU of cached blocks no one holds.

A full block's hash chains its parent's hash and its own token ids, so equal hashes mean equal
prefixes (up to a 128-bit blake2b collision). The BlockManager registers a block only when it is
full AND its target K/V AND its draft context are written, so a hit restores both at once.

A registered block stays registered while sequences hold it (refcount > 0) and after the last one
lets go (refcount 0): then it is "cached", evictable in LRU order, and still matchable until it is
evicted for reuse. This class knows nothing of refcounts; the BlockManager parks and touches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator

BlockHash = bytes
HASH_BYTES = 16


def hash_block(parent: BlockHash | None, token_ids: array) -> BlockHash:
    """hash_i = blake2b(hash_{i-1} || token ids of block i); the first block has no parent."""
    return hashlib.blake2b((parent or b"") + token_ids.tobytes(), digest_size=HASH_BYTES).digest()


def hash_chain(token_ids: array, tokens_per_block: int, num_blocks: int,
               parent: BlockHash | None = None) -> Iterator[BlockHash]:
    """Hashes of the first `num_blocks` full blocks of `token_ids`, lazily (a lookup stops early)."""
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * tokens_per_block:(i + 1) * tokens_per_block])
        yield parent


class PrefixCache:
    """hash <-> block for registered blocks, the LRU of evictable ones, and hit counters (tokens)."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # Registered blocks with refcount 0, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.query_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_ids(self) -> tuple[int, ...]:
        """Evictable blocks, next to be evicted first."""
        return tuple(self._evictable)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def match(self, hashes: Iterator[BlockHash]) -> list[int]:
        """Blocks of the longest registered prefix of the chain `hashes` (stops at the first miss)."""
        hits = []
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name `block_id` by `block_hash` unless that content is already cached under another block.

        Duplicates are not merged (block tables stay append-only): the second copy simply stays
        unregistered and returns to the free list when released.
        """
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """A registered block's last holder let go: it becomes the most recent evictable block."""
        self._evictable[block_id] = None

    def touch(self, block_id: int) -> None:
        """A hit on an evictable block takes it back into use."""
        del self._evictable[block_id]

    def evict(self) -> int:
        """Forget the least recently released cached block and return its id for reuse."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        return block_id

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens looked up (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

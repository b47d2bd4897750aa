"""The pool's control interface: the batched verbs the scheduler calls once per step, and their types.

Two things implement `PoolControl`: the in-process `BlockManager` (kvpool_service.block_manager) and the
gRPC `KVPoolClient` (kvpool_service.client) talking to a `dflash kvpool` server. Both raise the same
typed errors (kvpool_service.errors), so the engine runs unchanged against either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable


class OpenRequest(NamedTuple):
    seq_id: int
    prompt_token_ids: Sequence[int]


class OpenResult(NamedTuple):
    seq_id: int
    seq_index: int  # the sequence's row in the pool's per-sequence tables (0..max_num_seqs-1)
    num_cached_tokens: int  # restored from the prefix cache: target K/V and draft context both
    block_table: list[int]  # the sequence's block ids, covering the prompt


class ReserveRequest(NamedTuple):
    seq_id: int
    length: int  # capacity wanted: positions 0..length-1


class CommitRequest(NamedTuple):
    seq_id: int
    num_tokens: int  # positions whose target K/V is written
    num_context: int  # positions whose draft context is stored (<= num_tokens)
    token_ids: Sequence[int] = ()  # ids of tokens past those already known (prompt + earlier commits)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """A snapshot of the pool's blocks and prefix cache, for PoolStats and the metrics."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # refcount 0, still in the prefix cache, evictable
    num_used_blocks: int
    num_seqs: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens restored

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class PoolLimits(NamedTuple):
    """What a pool can hold, for refusing at submission a request that could never run."""

    num_blocks: int
    tokens_per_block: int
    max_num_seqs: int
    max_model_len: int
    max_blocks_per_seq: int  # num_blocks less the admission watermark

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)


@runtime_checkable
class PoolControl(Protocol):
    """What the scheduler needs from a pool. Every call is batched and all-or-nothing."""

    def open(self, requests: Sequence[OpenRequest]) -> list[OpenResult]:
        """Slots, prefix-cache hits and blocks for whole prompts; PoolExhausted leaves nothing open."""
        ...

    def reserve(self, requests: Sequence[ReserveRequest]) -> list[list[int]]:
        """Grow capacities; per request, the block ids appended to its block table."""
        ...

    def commit(self, requests: Sequence[CommitRequest]) -> None:
        """Record written lengths (and new token ids) after a step."""
        ...

    def close(self, seq_ids: Sequence[int]) -> None:
        """Release the sequences' blocks and indices."""
        ...

    def stats(self) -> PoolUsage: ...

    def limits(self) -> PoolLimits:
        """Sizes that do not change while the pool lives (read once, at assembly)."""
        ...

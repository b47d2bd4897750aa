"""BlockManager: which blocks of the KV pool each sequence holds, and the prefix cache over them.

Pure bookkeeping over ints (no tensors, no gRPC): the engine copies `block_table` rows into a device
tensor, the gRPC server translates protos into these calls. Every entry point is batched (the
scheduler calls once per step for the whole batch) and all-or-nothing: it validates and counts
first and raises a typed error (kvpool_service.errors) before anything changes. Requests are the
NamedTuples of kvpool_service.control or plain tuples in the same field order (the server's).

Every block is in exactly one state:
  free    - on the free list, holds nothing anyone can use;
  cached  - refcount 0 but registered in the prefix cache: evictable (LRU), still matchable;
  in use  - refcount = number of open sequences whose block table holds it.
free + cached + in use = num_blocks, always. Only registered (prefix-cache) blocks are ever held by
more than one sequence.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

# The control vocabulary lives in kvpool_service.control; it is importable from here too.
from kvpool_service.control import (
    CommitRequest,
    OpenRequest,
    OpenResult,
    PoolLimits,
    PoolUsage,
    ReserveRequest,
)
from kvpool_service.errors import InvalidRequest, LimitExceeded, PoolExhausted, StaleEpoch, UnknownSequence
from kvpool_service.prefix_cache import PrefixCache, hash_block, hash_chain
from kvpool_service.sequence_blocks import (
    MAX_SEQ_ID,
    TOKEN_TYPECODE,
    SequenceBlocks,
    check_index,
    check_unique,
    token_array,
)

if TYPE_CHECKING:
    from kvpool_service.geometry import PoolLayout

class _OpenPlan(NamedTuple):
    seq_id: int
    token_ids: array
    hits: list[int]
    num_new_blocks: int


class BlockManager:
    """Blocks, sequence indices and the prefix cache of one pool. Not thread-safe: one caller at a time."""

    def __init__(self, num_blocks: int, tokens_per_block: int, *, max_num_seqs: int, max_model_len: int,
                 watermark: float = 0.01, epoch: int = 0, enable_prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("tokens_per_block", tokens_per_block),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if check_index(value, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {value}")
        if not 0.0 <= watermark < 1.0:
            raise InvalidRequest(f"watermark must be a fraction in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # Admission keeps this many blocks free so running sequences can grow before new ones enter.
        self.watermark_blocks = int(watermark * num_blocks)
        self.epoch = epoch
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_seq_indices = list(range(max_num_seqs))  # a min-heap: the lowest is reused first
        self._cache = PrefixCache()
        self._seqs: dict[int, SequenceBlocks] = {}

    @classmethod
    def from_layout(cls, layout: PoolLayout, *, max_num_seqs: int, max_model_len: int,
                    **kwargs) -> BlockManager:
        """The manager of a live pool: its blocks, tokens per block and epoch."""
        return cls(layout.num_blocks, layout.spec.tokens_per_block, max_num_seqs=max_num_seqs,
                   max_model_len=max_model_len, epoch=layout.epoch, **kwargs)

    # ---- reading --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def open_seq_ids(self) -> list[int]:
        return list(self._seqs)

    def get(self, seq_id: int) -> SequenceBlocks:
        """The live record of an open sequence (read it, never write it)."""
        try:
            seq = self._seqs.get(seq_id)
        except TypeError:  # unhashable: certainly not an open sequence
            seq = None
        if seq is None:
            raise UnknownSequence(f"sequence {seq_id!r} is not open", seq_id=seq_id)
        return seq

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return self._cache.num_evictable

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take: free ones first, then cached ones by eviction."""
        return len(self._free) + self._cache.num_evictable

    def limits(self) -> PoolLimits:
        return PoolLimits(self.num_blocks, self.tokens_per_block, self.max_num_seqs, self.max_model_len,
                          self.num_blocks - self.watermark_blocks)

    def free_block_ids(self) -> tuple[int, ...]:
        return tuple(self._free)

    def cached_block_ids(self) -> tuple[int, ...]:
        """Evictable cached blocks, the next to be evicted first."""
        return self._cache.evictable_ids()

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def is_registered(self, block_id: int) -> bool:
        """Whether the block is in the prefix cache (held or not)."""
        return self._cache.is_registered(block_id)

    def stats(self) -> PoolUsage:
        free, cached = len(self._free), self._cache.num_evictable
        return PoolUsage(
            num_blocks=self.num_blocks, num_free_blocks=free, num_cached_blocks=cached,
            num_used_blocks=self.num_blocks - free - cached, num_seqs=len(self._seqs),
            prefix_cache_queries=self._cache.query_tokens, prefix_cache_hits=self._cache.hit_tokens,
        )

    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpoch(f"epoch {epoch} is not this pool's epoch; fetch the layout again")

    # ---- open -----------------------------------------------------------------------------------

    def open(self, requests: Sequence[OpenRequest]) -> list[OpenResult]:
        """Give each new sequence an index, its prefix-cache hit and blocks for its whole prompt.

        Admission leaves `watermark_blocks` available for the running sequences to grow into.
        """
        self._check_batch_size(requests, "open")
        plans = [self._plan_open(request) for request in requests]
        self._check_new_ids([plan.seq_id for plan in plans])
        if len(plans) > len(self._free_seq_indices):
            raise PoolExhausted(
                f"{len(plans)} sequences to open but only {len(self._free_seq_indices)} of "
                f"{self.max_num_seqs} sequence indices are free", needed=len(plans),
                available=len(self._free_seq_indices), resource="sequences")
        # Hits on cached (refcount 0) blocks take them out of the evictable set before any allocation.
        revived = {block for plan in plans for block in plan.hits if self._ref_count[block] == 0}
        needed = sum(plan.num_new_blocks for plan in plans)
        available = self.num_available_blocks - len(revived)
        if needed + self.watermark_blocks > available:
            raise PoolExhausted(
                f"opening {len(plans)} sequences needs {needed} blocks plus the watermark of "
                f"{self.watermark_blocks}; {available} are available",
                needed=needed + self.watermark_blocks, available=available)
        for block in revived:
            self._cache.touch(block)
        return [self._start(plan) for plan in plans]

    def _plan_open(self, request: OpenRequest) -> _OpenPlan:
        seq_id, prompt = request
        seq_id = check_index(seq_id, "seq_id")
        if seq_id > MAX_SEQ_ID:
            raise InvalidRequest(f"seq_id must fit in 64 bits, got {seq_id}")
        tokens = token_array(prompt, "prompt_token_ids", seq_id)
        tpb, n = self.tokens_per_block, len(tokens)
        if n == 0:
            raise InvalidRequest(f"sequence {seq_id} has an empty prompt; at least one token is needed")
        if n > self.max_model_len:
            raise LimitExceeded(f"prompt of sequence {seq_id} has {n} tokens; max_model_len is "
                                f"{self.max_model_len}")
        num_blocks = -(-n // tpb)
        if num_blocks + self.watermark_blocks > self.num_blocks:
            raise LimitExceeded(f"prompt of sequence {seq_id} needs {num_blocks} blocks; the pool has "
                                f"{self.num_blocks}, {self.watermark_blocks} of them held back")
        hits = []
        if self.enable_prefix_caching:
            # At most (n-1)//tpb blocks: the last prompt token is always recomputed, since its logits
            # and its hidden states (the taps of the first draft) are needed.
            hits = self._cache.match(hash_chain(tokens, tpb, (n - 1) // tpb))
        return _OpenPlan(seq_id, tokens, hits, num_blocks - len(hits))

    def _start(self, plan: _OpenPlan) -> OpenResult:
        seq_index = heapq.heappop(self._free_seq_indices)
        for block in plan.hits:
            self._ref_count[block] += 1
        block_table = plan.hits + self._allocate(plan.num_new_blocks)
        num_cached = len(plan.hits) * self.tokens_per_block
        self._seqs[plan.seq_id] = SequenceBlocks(
            seq_id=plan.seq_id, seq_index=seq_index, block_table=block_table, num_cached_tokens=num_cached,
            num_tokens=num_cached, num_context=num_cached, token_ids=plan.token_ids,
            num_hashed_blocks=len(plan.hits),
            last_hash=self._cache.hash_of(plan.hits[-1]) if plan.hits else None,
        )
        self._cache.record_query(len(plan.token_ids), num_cached)
        return OpenResult(plan.seq_id, seq_index, num_cached, list(block_table))

    # ---- reserve --------------------------------------------------------------------------------

    def blocks_needed(self, requests: Sequence[ReserveRequest]) -> int:
        """New blocks `reserve(requests)` would take (validates like reserve, changes nothing)."""
        return sum(need for _, need in self._plan_reserve(requests))

    def reserve_shortfall(self, requests: Sequence[ReserveRequest]) -> int:
        """Blocks to release (by preemption) before `reserve(requests)` succeeds; 0 when it fits."""
        return max(0, self.blocks_needed(requests) - self.num_available_blocks)

    def reserve(self, requests: Sequence[ReserveRequest]) -> list[list[int]]:
        """Grow each sequence's capacity to at least `length` positions (never shrinks).

        Returns, per request, the block ids appended to its block table (often none). Running
        sequences may use the admission watermark.
        """
        plan = self._plan_reserve(requests)
        needed = sum(need for _, need in plan)
        if needed > self.num_available_blocks:
            raise PoolExhausted(f"reserve needs {needed} blocks; {self.num_available_blocks} are available",
                                needed=needed, available=self.num_available_blocks)
        appended = []
        for seq, need in plan:
            new = self._allocate(need) if need else []
            seq.block_table.extend(new)
            appended.append(new)
        return appended

    def _plan_reserve(self, requests: Sequence[ReserveRequest]) -> list[tuple[SequenceBlocks, int]]:
        """(sequence, new blocks it needs) per request; validates everything, changes nothing."""
        self._check_batch_size(requests, "reserve")
        seqs, tpb, max_len, plan = self._seqs, self.tokens_per_block, self.max_model_len, []
        for seq_id, length in requests:
            seq = seqs.get(seq_id) if type(seq_id) is int else None
            if seq is None or type(length) is not int or not 0 <= length <= max_len:
                seq = self.get(seq_id)
                length = check_index(length, "reserve length", seq_id)
                if length > max_len:
                    raise LimitExceeded(f"sequence {seq_id} asks for {length} positions; max_model_len is "
                                        f"{max_len}")
            need = -(-length // tpb) - len(seq.block_table)
            plan.append((seq, need if need > 0 else 0))
        check_unique([seq.seq_id for seq, _ in plan])
        return plan

    # ---- commit ---------------------------------------------------------------------------------

    def commit(self, requests: Sequence[CommitRequest]) -> None:
        """Record the lengths written this step; blocks that became full and fully written (target
        K/V and draft context, token ids known) enter the prefix cache."""
        self._check_batch_size(requests, "commit")
        seqs, tpb, max_len = self._seqs, self.tokens_per_block, self.max_model_len
        plan, ids = [], []
        for request in requests:
            seq_id, num_tokens, num_context, token_ids = request
            ids.append(seq_id)
            seq = seqs.get(seq_id) if type(seq_id) is int else None
            try:
                new_ids = array(TOKEN_TYPECODE, token_ids)
            except (TypeError, OverflowError, ValueError):
                new_ids = None
            # The hot path accepts plain, valid ints; anything else is checked (and named) slowly.
            if (seq is None or new_ids is None or type(num_tokens) is not int or type(num_context) is not int
                    or not seq.num_context <= num_context <= num_tokens <= len(seq.block_table) * tpb
                    or num_tokens < seq.num_tokens or num_tokens > max_len
                    or len(seq.token_ids) + len(new_ids) > max_len):
                plan.append(self._plan_commit(request))
            else:
                plan.append((seq, num_tokens, num_context, new_ids))
        check_unique(ids)
        for seq, num_tokens, num_context, new_ids in plan:
            seq.num_tokens, seq.num_context = num_tokens, num_context
            if new_ids:
                seq.token_ids.extend(new_ids)
            # num_context <= num_tokens, so this is min(num_tokens, num_context, known ids) // tpb.
            if (self.enable_prefix_caching
                    and min(num_context, len(seq.token_ids)) // tpb > seq.num_hashed_blocks):
                self._register_full_blocks(seq)

    def _plan_commit(self, request: CommitRequest):
        """Full validation of one commit entry: raises the precise error, or returns it normalized."""
        seq_id, num_tokens, num_context, token_ids = request
        seq = self.get(seq_id)
        num_tokens = check_index(num_tokens, "num_tokens", seq_id)
        num_context = check_index(num_context, "num_context", seq_id)
        if num_tokens < seq.num_tokens or num_context < seq.num_context:
            raise InvalidRequest(
                f"sequence {seq_id} lengths cannot shrink: num_tokens {seq.num_tokens} -> {num_tokens}, "
                f"num_context {seq.num_context} -> {num_context}")
        if num_context > num_tokens:
            raise InvalidRequest(f"sequence {seq_id} has num_context {num_context} > num_tokens "
                                 f"{num_tokens}; draft context comes from committed tokens")
        if num_tokens > self.max_model_len:
            raise LimitExceeded(f"sequence {seq_id} commits {num_tokens} tokens; max_model_len is "
                                f"{self.max_model_len}")
        capacity = len(seq.block_table) * self.tokens_per_block
        if num_tokens > capacity:
            raise InvalidRequest(f"sequence {seq_id} commits {num_tokens} tokens but has reserved only "
                                 f"{capacity}; reserve first")
        new_ids = token_array(() if token_ids is None else token_ids, "token_ids", seq_id)
        if len(seq.token_ids) + len(new_ids) > self.max_model_len:
            raise LimitExceeded(f"sequence {seq_id} would know {len(seq.token_ids) + len(new_ids)} "
                                f"token ids; max_model_len is {self.max_model_len}")
        return seq, num_tokens, num_context, new_ids

    def _register_full_blocks(self, seq: SequenceBlocks) -> None:
        tpb, tokens, block_table = self.tokens_per_block, seq.token_ids, seq.block_table
        register = self._cache.register
        # A block is cacheable once full, its K/V and draft context written, and its ids known.
        num_full = min(seq.num_context, len(tokens)) // tpb
        last_hash = seq.last_hash
        for i in range(seq.num_hashed_blocks, num_full):
            last_hash = hash_block(last_hash, tokens[i * tpb:(i + 1) * tpb])
            register(block_table[i], last_hash)
        seq.last_hash = last_hash
        seq.num_hashed_blocks = num_full

    # ---- close ----------------------------------------------------------------------------------

    def close(self, seq_ids: Sequence[int]) -> None:
        """Release the sequences' blocks and indices; registered blocks stay matchable as cached."""
        self._check_batch_size(seq_ids, "close")
        seqs = [self.get(seq_id) for seq_id in seq_ids]
        check_unique([seq.seq_id for seq in seqs])
        for seq in seqs:
            # Tail first: the end of a hash chain is evicted before its (more shared) beginning.
            for block in reversed(seq.block_table):
                self._ref_count[block] -= 1
                if self._ref_count[block] == 0:
                    if self._cache.is_registered(block):
                        self._cache.park(block)
                    else:
                        self._free.append(block)
            heapq.heappush(self._free_seq_indices, seq.seq_index)
            del self._seqs[seq.seq_id]

    # ---- helpers --------------------------------------------------------------------------------

    def _allocate(self, count: int) -> list[int]:
        """`count` blocks with refcount 1: free ones first, then the least recently cached."""
        blocks = []
        for _ in range(count):
            block = self._free.popleft() if self._free else self._cache.evict()
            self._ref_count[block] = 1
            blocks.append(block)
        return blocks

    def _check_batch_size(self, requests: Sequence, verb: str) -> None:
        if len(requests) > self.max_num_seqs:
            raise LimitExceeded(f"{verb} batch has {len(requests)} entries; max_num_seqs is "
                                f"{self.max_num_seqs}")

    def _check_new_ids(self, seq_ids: list[int]) -> None:
        check_unique(seq_ids)
        for seq_id in seq_ids:
            if seq_id in self._seqs:
                raise InvalidRequest(f"sequence {seq_id} is already open")

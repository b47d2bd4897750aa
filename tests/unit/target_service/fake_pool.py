"""A `PoolControl` by hand, for the scheduler's and the engine's unit tests: blocks counted in plain
Python, all-or-nothing like the real pool, every call kept."""

from __future__ import annotations

from kvpool_service.control import OpenResult, PoolLimits, PoolUsage
from kvpool_service.errors import PoolExhausted

TOKENS_PER_BLOCK = 4

class FakePool:
    """`PoolControl` by hand: every sequence holds ceil(capacity / 4) blocks out of `num_blocks`; calls
    are all-or-nothing, as the real pool's; the calls made are kept in `calls`."""

    def __init__(self, num_blocks: int, *, max_num_seqs: int = 8):
        self.num_blocks, self.max_num_seqs = num_blocks, max_num_seqs
        self.blocks: dict[int, list[int]] = {}  # seq_id -> its block ids
        self.free = list(range(num_blocks))
        self.calls: list[tuple] = []

    def _grow(self, plan: dict[int, int]) -> dict[int, list[int]]:
        needed = {seq_id: max(0, -(-length // TOKENS_PER_BLOCK) - len(self.blocks.get(seq_id, [])))
                  for seq_id, length in plan.items()}
        if sum(needed.values()) > len(self.free):
            raise PoolExhausted(f"{sum(needed.values())} blocks wanted, {len(self.free)} free")
        added = {}
        for seq_id, count in needed.items():
            added[seq_id] = [self.free.pop(0) for _ in range(count)]
            self.blocks.setdefault(seq_id, []).extend(added[seq_id])
        return added

    def open(self, requests):
        self.calls.append(("open", [r.seq_id for r in requests]))
        if len(self.blocks) + len(requests) > self.max_num_seqs:
            raise PoolExhausted("no sequence index free", resource="sequences")
        added = self._grow({r.seq_id: len(r.prompt_token_ids) for r in requests})
        return [OpenResult(r.seq_id, r.seq_id, 0, added[r.seq_id]) for r in requests]

    def reserve(self, requests):
        self.calls.append(("reserve", [(r.seq_id, r.length) for r in requests]))
        added = self._grow({r.seq_id: r.length for r in requests})
        return [added[r.seq_id] for r in requests]

    def commit(self, requests):
        self.calls.append(("commit", [r.seq_id for r in requests]))

    def close(self, seq_ids):
        self.calls.append(("close", list(seq_ids)))
        for seq_id in seq_ids:
            self.free += self.blocks.pop(seq_id)

    def stats(self) -> PoolUsage:
        used = sum(len(blocks) for blocks in self.blocks.values())
        return PoolUsage(self.num_blocks, len(self.free), 0, used, len(self.blocks), 0, 0)

    def limits(self) -> PoolLimits:
        return PoolLimits(self.num_blocks, TOKENS_PER_BLOCK, self.max_num_seqs, 1024, self.num_blocks)

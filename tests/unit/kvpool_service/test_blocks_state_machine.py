"""BlockManager under random interleavings of open / reserve / commit / close and bad requests.

The test keeps its own model: what each live sequence committed, and a shadow of every page (the
token id whose target K/V, and whose draft context, was written into each slot of each block).
A prefix hit is checked against that shadow, so the cache can never hand out pages holding other
tokens, or pages whose draft context was never written.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool_service.block_manager import BlockManager, CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import InvalidRequest, LimitExceeded, PoolExhausted, UnknownSequence

TPB = 4
NUM_BLOCKS = 12
MAX_NUM_SEQS = 5
MAX_MODEL_LEN = 32

# Prompts share prefixes often: a few stems of whole blocks, then a short random tail.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4], []]
prompts = st.builds(lambda stem, tail: (stem + tail)[:MAX_MODEL_LEN] or [0],
                    st.sampled_from(STEMS), st.lists(st.integers(0, 3), max_size=12))


def observable(bm: BlockManager):
    seqs = {s: (r.seq_index, list(r.block_table), r.num_tokens, r.num_context, list(r.token_ids))
            for s, r in ((s, bm.get(s)) for s in list(bm._seqs))}
    return (bm.stats(), bm.free_block_ids(), bm.cached_block_ids(),
            [bm.ref_count(b) for b in range(NUM_BLOCKS)], seqs)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(watermark=st.sampled_from([0.0, 0.1]))
    def start(self, watermark):
        self.bm = BlockManager(NUM_BLOCKS, TPB, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                               watermark=watermark)
        self.next_id = 0
        self.live: dict[int, list[int]] = {}  # seq_id -> token ids known to the engine
        # Shadow pages: page[block][i] = token whose K/V (or draft context) sits in slot i.
        self.kv = [[None] * TPB for _ in range(NUM_BLOCKS)]
        self.ctx = [[None] * TPB for _ in range(NUM_BLOCKS)]

    def _write(self, pages, seq_id, start, stop):
        record, tokens = self.bm.get(seq_id), self.live[seq_id]
        for pos in range(start, stop):
            pages[record.block_table[pos // TPB]][pos % TPB] = tokens[pos]

    def _attempt(self, error, call):
        """(True, result) or, when `call` raises `error`, (False, error) after checking nothing changed."""
        before = observable(self.bm)
        try:
            return True, call()
        except error as raised:
            assert observable(self.bm) == before, "a rejected call changed the pool"
            return False, raised

    @rule(batch=st.lists(prompts, min_size=1, max_size=3))
    def open(self, batch):
        ids = list(range(self.next_id, self.next_id + len(batch)))
        self.next_id += len(batch)
        requests = [OpenRequest(i, p) for i, p in zip(ids, batch)]
        available = self.bm.num_available_blocks
        ok, results = self._attempt((PoolExhausted, LimitExceeded), lambda: self.bm.open(requests))
        if not ok:
            if isinstance(results, PoolExhausted):  # counted in sequences or in blocks
                free_seq_indices = MAX_NUM_SEQS - len(self.live)
                assert results.needed > results.available
                if results.resource == "sequences":
                    assert results.available == free_seq_indices
                else:  # blocks revived by hits are not available for the rest
                    assert results.available <= available
            return
        for request, result in zip(requests, results):
            self.live[request.seq_id] = list(request.prompt_token_ids)
            for block in result.block_table[result.num_cached_tokens // TPB:]:  # fresh pages: no content
                self.kv[block], self.ctx[block] = [None] * TPB, [None] * TPB
            self._check_hit(request, result)

    def _check_hit(self, request, result):
        n, tokens = result.num_cached_tokens, request.prompt_token_ids
        assert n % TPB == 0 and n <= len(tokens) - 1
        assert len(result.block_table) == -(-len(tokens) // TPB)
        for pos in range(n):  # the hit restores target K/V and draft context of exactly these tokens
            block = result.block_table[pos // TPB]
            assert self.kv[block][pos % TPB] == tokens[pos] == self.ctx[block][pos % TPB]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reserve(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        grow = data.draw(st.lists(st.integers(0, 9), min_size=len(ids), max_size=len(ids)))
        requests = [ReserveRequest(i, min(MAX_MODEL_LEN, self.bm.get(i).num_tokens + g))
                    for i, g in zip(ids, grow)]
        shortfall = self.bm.reserve_shortfall(requests)
        ok, appended_lists = self._attempt(PoolExhausted, lambda: self.bm.reserve(requests))
        assert ok == (shortfall == 0)
        if not ok:
            assert appended_lists.shortfall == shortfall
            return
        for request, appended in zip(requests, appended_lists):
            table = self.bm.get(request.seq_id).block_table
            assert len(table) == max(len(table) - len(appended), -(-request.length // TPB))
            for block in appended:
                self.kv[block], self.ctx[block] = [None] * TPB, [None] * TPB

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        requests, writes = [], []
        for seq_id in ids:
            record = self.bm.get(seq_id)
            top = min(len(record.block_table) * TPB, MAX_MODEL_LEN)
            num_tokens = data.draw(st.integers(record.num_tokens, top))
            num_context = data.draw(st.integers(record.num_context, num_tokens))
            # The engine knows the committed tokens' ids (and sometimes one more: the next bonus).
            known = len(self.live[seq_id])
            want = min(MAX_MODEL_LEN, max(known, num_tokens + data.draw(st.integers(0, 1))))
            new_ids = data.draw(st.lists(st.integers(0, 3), min_size=want - known, max_size=want - known))
            requests.append(CommitRequest(seq_id, num_tokens, num_context, new_ids))
            writes.append((seq_id, record.num_tokens, num_tokens, record.num_context, num_context))
        for request in requests:
            self.live[request.seq_id] += request.token_ids
        for seq_id, t0, t1, c0, c1 in writes:  # the engine writes pages, then commits
            self._write(self.kv, seq_id, t0, t1)
            self._write(self.ctx, seq_id, c0, c1)
        self.bm.commit(requests)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def close(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        self.bm.close(ids)
        for seq_id in ids:
            del self.live[seq_id]
            assert seq_id not in self.bm

    @precondition(lambda self: self.live)
    @rule(data=st.data(), kind=st.sampled_from(["unknown", "shrink", "duplicate"]))
    def bad_request(self, data, kind):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        record = self.bm.get(seq_id)
        calls = {
            "unknown": (UnknownSequence, lambda: self.bm.close([seq_id, 10**9])),
            "shrink": (InvalidRequest, lambda: self.bm.commit(
                [CommitRequest(seq_id, record.num_tokens, record.num_context + 1)]
                if record.num_context == record.num_tokens
                else [CommitRequest(seq_id, record.num_tokens - 1, 0)])),
            "duplicate": (InvalidRequest, lambda: self.bm.reserve(
                [ReserveRequest(seq_id, 1), ReserveRequest(seq_id, 2)])),
        }
        error, call = calls[kind]
        ok, _ = self._attempt(error, call)
        assert not ok

    @invariant()
    def every_block_in_exactly_one_state(self):
        bm = self.bm
        free, cached = bm.free_block_ids(), bm.cached_block_ids()
        holders = Counter(b for s in self.live for b in bm.get(s).block_table)
        assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
        assert set(free).isdisjoint(cached) and set(holders).isdisjoint(free)
        assert set(holders).isdisjoint(cached)
        assert set(free) | set(cached) | set(holders) == set(range(NUM_BLOCKS))
        for block in range(NUM_BLOCKS):
            assert bm.ref_count(block) == holders[block]
            if holders[block] > 1 or block in cached:  # only cached prefixes are ever shared
                assert bm.is_registered(block)
            if block in free:
                assert not bm.is_registered(block)
        stats = bm.stats()
        assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_used_blocks) == (
            len(free), len(cached), len(holders))
        assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_used_blocks == NUM_BLOCKS

    @invariant()
    def sequences_match_the_model(self):
        bm = self.bm
        assert len(bm) == len(self.live) == bm.stats().num_seqs
        indices = [bm.get(s).seq_index for s in self.live]
        assert len(set(indices)) == len(indices) and all(0 <= i < MAX_NUM_SEQS for i in indices)
        for seq_id, tokens in self.live.items():
            record = bm.get(seq_id)
            assert list(record.token_ids) == tokens
            assert len(set(record.block_table)) == len(record.block_table)
            assert record.num_context <= record.num_tokens <= len(record.block_table) * TPB


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase

"""BlockManager, one rule per test, with hand-computed expectations (tokens_per_block = 4)."""

from __future__ import annotations

import random

import pytest

from kvpool_service.block_manager import BlockManager, CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import (
    InvalidRequest,
    LimitExceeded,
    PoolExhausted,
    StaleEpoch,
    UnknownSequence,
)

TPB = 4


def make(num_blocks=16, *, max_num_seqs=4, max_model_len=64, watermark=0.0, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, TPB, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        watermark=watermark, **kwargs)


def snapshot(bm: BlockManager):
    """Everything observable, to show a rejected call changed nothing."""
    seqs = {}
    for seq_id in list(bm._seqs):
        seq = bm.get(seq_id)
        seqs[seq_id] = (seq.seq_index, list(seq.block_table), seq.num_tokens, seq.num_context,
                        seq.num_cached_tokens, list(seq.token_ids), seq.num_hashed_blocks, seq.last_hash)
    return (bm.stats(), bm.free_block_ids(), bm.cached_block_ids(),
            [bm.ref_count(b) for b in range(bm.num_blocks)],
            [bm.is_registered(b) for b in range(bm.num_blocks)], seqs, sorted(bm._free_seq_indices))


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def run_prefill(bm, seq_id, tokens):
    """What the engine does after open: write the whole prompt's target K/V and draft context."""
    bm.commit([CommitRequest(seq_id, len(tokens), len(tokens))])


def test_open_gives_lowest_free_seq_index_and_blocks_for_whole_prompt():
    bm = make()
    [a, b] = bm.open([OpenRequest(7, prompt(9)), OpenRequest(3, prompt(4, 1))])
    assert (a.seq_index, a.num_cached_tokens, len(a.block_table)) == (0, 0, 3)  # ceil(9 / 4)
    assert (b.seq_index, len(b.block_table)) == (1, 1)
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.get(7).block_table == a.block_table
    assert bm.stats().num_used_blocks == 4 and bm.num_free_blocks == 12


def test_seq_index_of_closed_sequence_is_reused():
    bm = make()
    bm.open([OpenRequest(i, [i]) for i in range(3)])
    bm.close([1])
    [r] = bm.open([OpenRequest(9, [5])])
    assert r.seq_index == 1


def test_reserve_grows_to_ceil_of_length_and_never_shrinks():
    bm = make()
    bm.open([OpenRequest(1, prompt(3))])
    [new] = bm.reserve([ReserveRequest(1, 9)])  # ceil(9/4) = 3 blocks, 1 already held
    assert len(new) == 2 and bm.get(1).block_table[1:] == new
    assert bm.reserve([ReserveRequest(1, 5)]) == [[]]
    assert len(bm.get(1).block_table) == 3


def test_reserve_is_all_or_nothing_and_reports_shortfall():
    bm = make(num_blocks=6)
    bm.open([OpenRequest(1, [1]), OpenRequest(2, [2])])  # 4 blocks left
    requests = [ReserveRequest(1, 12), ReserveRequest(2, 12)]  # 2 + 2 more: fits
    assert bm.blocks_needed(requests) == 4 and bm.reserve_shortfall(requests) == 0
    too_many = [ReserveRequest(1, 12), ReserveRequest(2, 16)]  # 2 + 3 = 5 > 4
    assert bm.reserve_shortfall(too_many) == 1
    before = snapshot(bm)
    with pytest.raises(PoolExhausted) as info:
        bm.reserve(too_many)
    assert (info.value.needed, info.value.available, info.value.shortfall) == (5, 4, 1)
    assert snapshot(bm) == before


def test_commit_validates_lengths_and_changes_nothing_when_rejected():
    bm = make(max_model_len=10)
    bm.open([OpenRequest(1, prompt(5)), OpenRequest(2, prompt(2))])  # capacity 8 and 4
    bm.commit([CommitRequest(1, 5, 4)])
    before = snapshot(bm)
    cases = [
        (CommitRequest(1, 4, 4), InvalidRequest, "cannot shrink"),
        (CommitRequest(1, 5, 3), InvalidRequest, "cannot shrink"),
        (CommitRequest(1, 6, 7), InvalidRequest, "num_context 7 > num_tokens 6"),
        (CommitRequest(1, 9, 9), InvalidRequest, "reserved only 8"),
        (CommitRequest(1, -1, 0), InvalidRequest, "must be >= 0"),
        (CommitRequest(1, 5.0, 5), InvalidRequest, "must be an integer"),
        (CommitRequest(1, 6, 6, [1] * 6), LimitExceeded, "max_model_len is 10"),
        (CommitRequest(99, 1, 1), UnknownSequence, "99"),
    ]
    for bad, error, words in cases:
        # The valid first entry must not be applied when the second is rejected.
        with pytest.raises(error, match=words):
            bm.commit([CommitRequest(2, 2, 2), bad])
        assert snapshot(bm) == before


def test_commit_beyond_max_model_len_is_out_of_range():
    bm = make(max_model_len=6)
    bm.open([OpenRequest(1, prompt(6))])
    with pytest.raises(LimitExceeded, match="commits 7 tokens"):
        bm.commit([CommitRequest(1, 7, 0)])


def test_block_enters_cache_only_when_target_kv_and_context_are_written():
    bm = make()
    tokens = prompt(9)
    bm.open([OpenRequest(1, tokens)])
    bm.commit([CommitRequest(1, 9, 3)])  # target K/V of 2 full blocks, context of none
    bm.close([1])
    [r] = bm.open([OpenRequest(2, tokens)])
    assert r.num_cached_tokens == 0
    bm.commit([CommitRequest(2, 9, 5)])  # context now covers block 0 only
    bm.close([2])
    [r] = bm.open([OpenRequest(3, tokens)])
    assert r.num_cached_tokens == 4


def test_block_with_unknown_token_ids_is_not_cached():
    bm = make()
    bm.open([OpenRequest(1, prompt(3))])
    bm.reserve([ReserveRequest(1, 8)])
    bm.commit([CommitRequest(1, 8, 8)])  # ids known only for 3 positions: nothing is full and named
    assert not any(bm.is_registered(b) for b in bm.get(1).block_table)
    bm.commit([CommitRequest(1, 8, 8, [5, 6, 7, 8, 9])])  # now 8 ids: both blocks named
    assert all(bm.is_registered(b) for b in bm.get(1).block_table)


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = make()
    tokens = prompt(10)
    [a] = bm.open([OpenRequest(1, tokens)])
    run_prefill(bm, 1, tokens)
    [b] = bm.open([OpenRequest(2, [*tokens[:8], 77, 78, 79])])
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert bm.get(2).num_tokens == bm.get(2).num_context == 8
    stats = bm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)


def test_prefix_hit_always_leaves_the_last_prompt_token():
    bm = make()
    tokens = prompt(8)  # exactly two full blocks
    bm.open([OpenRequest(1, tokens)])
    run_prefill(bm, 1, tokens)
    [r] = bm.open([OpenRequest(2, tokens)])
    assert r.num_cached_tokens == 4  # not 8: token 7 is recomputed for its logits and taps


def test_same_block_after_different_prefix_is_a_miss():
    bm = make()
    first, second = [1, 2, 3, 4, 9, 9, 9, 9, 0], [5, 6, 7, 8, 9, 9, 9, 9, 0]
    bm.open([OpenRequest(1, first)])
    run_prefill(bm, 1, first)
    [r] = bm.open([OpenRequest(2, second)])  # block 1 equal, block 0 differs: the chain differs
    assert r.num_cached_tokens == 0


def test_hit_on_released_block_revives_it_from_the_cache():
    bm = make()
    tokens = prompt(9)
    [a] = bm.open([OpenRequest(1, tokens)])
    run_prefill(bm, 1, tokens)
    bm.close([1])
    assert set(bm.cached_block_ids()) == set(a.block_table[:2]) and a.block_table[2] in bm.free_block_ids()
    [b] = bm.open([OpenRequest(2, tokens)])
    assert b.block_table[:2] == a.block_table[:2] and bm.num_cached_blocks == 0
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1]


def test_eviction_takes_free_blocks_first_then_lru_chain_tail_first():
    bm = make(num_blocks=7)
    old, new = prompt(9, 1), prompt(9, 2)
    [a] = bm.open([OpenRequest(1, old)])
    run_prefill(bm, 1, old)
    bm.close([1])  # cached: a[1] (the tail) then a[0]
    [b] = bm.open([OpenRequest(2, new)])
    run_prefill(bm, 2, new)
    bm.close([2])
    assert bm.cached_block_ids() == (a.block_table[1], a.block_table[0], b.block_table[1], b.block_table[0])
    free_before = set(bm.free_block_ids())
    assert len(free_before) == 3
    [c] = bm.open([OpenRequest(3, prompt(16, 3))])  # 4 blocks: the 3 free ones, then evict a[1]
    assert set(c.block_table) == free_before | {a.block_table[1]}
    assert bm.cached_block_ids() == (a.block_table[0], b.block_table[1], b.block_table[0])
    assert not bm.is_registered(a.block_table[1])
    [d] = bm.open([OpenRequest(4, new)])  # b's prefix survived
    assert d.num_cached_tokens == 8 and d.block_table[:2] == b.block_table[:2]


def test_hits_in_a_batch_are_not_evicted_by_the_same_batch():
    bm = make(num_blocks=4)
    tokens = prompt(9)
    [a] = bm.open([OpenRequest(1, tokens)])
    run_prefill(bm, 1, tokens)
    bm.close([1])  # 2 cached, 2 free
    with pytest.raises(PoolExhausted):  # the hit revives 2 and needs 1 more, the other needs 2: 3 > 2
        bm.open([OpenRequest(2, tokens), OpenRequest(3, prompt(5, 9))])
    [b, c] = bm.open([OpenRequest(2, tokens), OpenRequest(3, [1])])
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.num_available_blocks == 0 and len({*b.block_table, *c.block_table}) == 4


def test_duplicate_content_is_cached_once():
    bm = make()
    tokens = prompt(5)
    bm.open([OpenRequest(1, tokens), OpenRequest(2, tokens)])  # both miss: computed twice
    bm.commit([CommitRequest(1, 5, 5), CommitRequest(2, 5, 5)])
    first, second = bm.get(1).block_table[0], bm.get(2).block_table[0]
    assert bm.is_registered(first) and not bm.is_registered(second)
    bm.close([1, 2])
    assert bm.cached_block_ids() == (first,) and second in bm.free_block_ids()


def test_admission_keeps_the_watermark_free_for_running_sequences():
    bm = make(num_blocks=10, watermark=0.2)  # 2 blocks held back from admission
    assert bm.watermark_blocks == 2
    bm.open([OpenRequest(1, [1])])  # 9 blocks left
    with pytest.raises(PoolExhausted, match="watermark of 2"):
        bm.open([OpenRequest(2, prompt(32))])  # 8 blocks + 2 > 9
    bm.open([OpenRequest(2, prompt(28))])  # 7 + 2 <= 9
    bm.reserve([ReserveRequest(1, 8)])  # growth may use the watermark
    assert bm.num_available_blocks == 1


def test_prompt_that_can_never_fit_is_out_of_range():
    bm = make(num_blocks=4, max_model_len=100)
    with pytest.raises(LimitExceeded, match="needs 5 blocks; the pool has 4"):
        bm.open([OpenRequest(1, prompt(17))])
    with pytest.raises(LimitExceeded, match="max_model_len is 100"):
        bm.open([OpenRequest(1, prompt(101))])


def test_seq_indices_and_batch_size_limits():
    bm = make(max_num_seqs=2)
    with pytest.raises(LimitExceeded, match="max_num_seqs is 2"):
        bm.open([OpenRequest(i, [1]) for i in range(3)])
    bm.open([OpenRequest(1, [1])])
    with pytest.raises(PoolExhausted, match="only 1 of 2 sequence indices"):
        bm.open([OpenRequest(2, [1]), OpenRequest(3, [1])])


def test_bad_open_requests_name_the_problem_and_change_nothing():
    bm = make()
    bm.open([OpenRequest(1, [1])])
    before = snapshot(bm)
    cases = [
        (OpenRequest(1, [2]), "already open"),
        (OpenRequest(2, []), "empty prompt"),
        (OpenRequest(2, [1, -5]), r"token ids in \[0, 2\*\*32\)"),
        (OpenRequest(2, [1, 2**32]), r"token ids in \[0, 2\*\*32\)"),
        (OpenRequest(2, [1.5]), "token ids"),
        (OpenRequest(2, "abc"), "token ids"),
        (OpenRequest(-1, [1]), "seq_id must be >= 0"),
        (OpenRequest(2**64, [1]), "64 bits"),
        (OpenRequest("x", [1]), "seq_id must be an integer"),
    ]
    for bad, words in cases:
        with pytest.raises(InvalidRequest, match=words):
            bm.open([OpenRequest(5, [1, 2]), bad])
        assert snapshot(bm) == before
    with pytest.raises(InvalidRequest, match="more than once"):
        bm.open([OpenRequest(5, [1]), OpenRequest(5, [2])])
    assert snapshot(bm) == before


def test_close_and_reserve_are_all_or_nothing():
    bm = make()
    bm.open([OpenRequest(1, [1]), OpenRequest(2, [2])])
    before = snapshot(bm)
    with pytest.raises(UnknownSequence, match="sequence 3 is not open"):
        bm.close([1, 3])
    with pytest.raises(InvalidRequest, match="more than once"):
        bm.close([1, 1])
    with pytest.raises(InvalidRequest, match="more than once"):
        bm.reserve([ReserveRequest(1, 8), ReserveRequest(1, 12)])
    with pytest.raises(LimitExceeded, match="asks for 65 positions"):
        bm.reserve([ReserveRequest(2, 8), ReserveRequest(1, 65)])
    assert snapshot(bm) == before
    bm.close([1, 2])
    assert len(bm) == 0 and bm.num_free_blocks == 16 and 1 not in bm
    with pytest.raises(UnknownSequence):
        bm.get(1)


def test_stale_epoch_is_refused():
    bm = make(epoch=41)
    bm.check_epoch(41)
    with pytest.raises(StaleEpoch, match="epoch 40"):
        bm.check_epoch(40)


def test_prefix_caching_can_be_turned_off():
    bm = make(enable_prefix_caching=False)
    tokens = prompt(9)
    bm.open([OpenRequest(1, tokens)])
    run_prefill(bm, 1, tokens)
    bm.close([1])
    [r] = bm.open([OpenRequest(2, tokens)])
    assert r.num_cached_tokens == 0 and bm.num_cached_blocks == 0


def test_constructor_rejects_bad_geometry():
    with pytest.raises(InvalidRequest, match="num_blocks must be >= 1"):
        BlockManager(0, TPB, max_num_seqs=1, max_model_len=8)
    with pytest.raises(InvalidRequest, match="watermark"):
        BlockManager(8, TPB, max_num_seqs=1, max_model_len=8, watermark=1.5)

"""LeasedPoolControl: leased reserves and queued commits change how often the pool is called, never
what it holds or what the caller is told.

The oracle of the random workloads is a bare BlockManager driven by the same calls: both must open
the same slots with the same prefix-cache hits, end with the same lengths and token ids, and every
caller's block table (the open's table extended by what reserve returned, as the scheduler does)
must equal the table its own pool holds. The other tests count inner calls by hand.
"""

from __future__ import annotations

import random
import threading

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from pool_workload import GRPC_TPB, ROOMY, TPB, CountingPool, Workload, make_manager, make_served

from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import InvalidRequest, PoolExhausted
from kvpool_service.leased_control import LeasedPoolControl
from kvpool_service.metered_client import MeteredKVPoolClient
from kvpool_service.server import BackgroundServer


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lease_tokens=st.sampled_from([0, 1, TPB, 7, 4 * TPB, 40]))
def test_leased_pool_matches_a_bare_pool_on_random_workloads(seed, lease_tokens):
    bare, behind = make_manager(), make_manager()
    with LeasedPoolControl(behind, lease_tokens=lease_tokens) as leased:
        workload = Workload(random.Random(seed), [(bare, bare), (leased, behind)])
        workload.run(60)
        assert leased.lease_stats.writer.async_errors == 0
        for i in workload.seqs:
            assert leased.block_table(i) == behind.get(i).block_table


# ---- lease arithmetic ------------------------------------------------------------------------------


def test_one_token_steps_renew_the_lease_once_per_lease_not_once_per_block():
    counting = CountingPool(make_manager(max_model_len=128))
    with LeasedPoolControl(counting, lease_tokens=4 * TPB) as pool:
        [opened] = pool.open([OpenRequest(1, [5])])  # 1 block: capacity 4
        table = list(opened.block_table)
        for length in range(2, 101):
            table.extend(pool.reserve([ReserveRequest(1, length)])[0])
            assert len(table) * TPB >= length
        # Asks of length + 16 at lengths 5, 25, 45, 65, 85 (capacities 24, 44, 64, 84, 104); an exact
        # reserve would have asked at 5, 9, ..., 97: 24 times.
        assert [r[0].length for r in counting.reserves] == [21, 41, 61, 81, 101]
        assert pool.lease_stats.reserves_answered_locally == 99 - 5
        assert table == pool.block_table(1) == counting.inner.get(1).block_table


def test_renewals_of_sequences_low_on_lease_share_one_rpc():
    counting = CountingPool(make_manager(max_model_len=128))
    with LeasedPoolControl(counting, lease_tokens=4 * TPB) as pool:
        pool.open([OpenRequest(1, [1] * 4), OpenRequest(2, [2] * 10)])  # capacities 4 and 12
        for step in range(1, 50):
            pool.reserve([ReserveRequest(1, 4 + step), ReserveRequest(2, 10 + step)])
        # 6 tokens apart, under half a lease (8): whenever one runs out the other is topped up too
        assert counting.calls["reserve"] == 3
        assert all(len(request) == 2 for request in counting.reserves)


def test_an_exhausted_lease_falls_back_to_the_exact_ask():
    manager = make_manager(num_blocks=3)
    with LeasedPoolControl(manager, lease_tokens=4 * TPB) as pool:
        [opened] = pool.open([OpenRequest(1, [1, 2, 3, 4])])
        with pytest.raises(PoolExhausted) as info:  # 4 blocks: not even the exact ask fits
            pool.reserve([ReserveRequest(1, 13)])
        assert (info.value.needed, info.value.available) == (3, 2)  # the exact ask's numbers
        assert manager.get(1).block_table == opened.block_table  # nothing changed
        [new] = pool.reserve([ReserveRequest(1, 12)])  # exactly the 2 blocks left
        assert opened.block_table + new == manager.get(1).block_table == pool.block_table(1)
        assert manager.num_available_blocks == 0
        assert pool.lease_stats.reserve_fallbacks == 2


def test_reserves_within_the_lease_call_nothing():
    counting = CountingPool(make_manager())
    with LeasedPoolControl(counting, lease_tokens=8) as pool:
        pool.open([OpenRequest(1, [1])])
        pool.commit([CommitRequest(1, 1, 1)])
        assert pool.reserve([ReserveRequest(1, 5)]) == [[1, 2, 3]]  # asks 13: 4 blocks, 16 tokens
        before = dict(counting.calls)
        for length in (5, 6, 12, 16, 0):
            assert pool.reserve([ReserveRequest(1, length)]) == [[]]
        assert dict(counting.calls) == before
        assert (pool.lease_stats.reserves_total, pool.lease_stats.reserves_answered_locally) == (6, 5)


# ---- the queue of commits and closes -----------------------------------------------------------------


class GatedPool(CountingPool):
    """Holds every commit until `gate` is set (`entered` says one is held), so later calls queue up."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.entered, self.commits = threading.Event(), threading.Event(), []

    def commit(self, requests):
        self.entered.set()
        self.gate.wait(10)
        self.commits.append([tuple(r) for r in requests])
        return super().commit(requests)


def test_a_refused_queued_commit_is_raised_once_on_the_next_call_with_its_type():
    manager = make_manager()
    with LeasedPoolControl(manager, lease_tokens=0) as pool:
        pool.open([OpenRequest(1, list(range(8)))])
        pool.commit([CommitRequest(1, 8, 8)])
        pool.commit([CommitRequest(1, 8, 4)])  # num_context shrinks: refused, asynchronously
        with pytest.raises(InvalidRequest, match="cannot shrink"):
            pool.stats()
        assert pool.stats().num_seqs == 1  # once only
        assert (manager.get(1).num_tokens, manager.get(1).num_context) == (8, 8)


def test_queued_commits_fold_into_one_rpc_yet_a_bad_one_is_still_refused():
    gated = GatedPool(make_manager())
    with LeasedPoolControl(gated, lease_tokens=0) as pool:
        pool.open([OpenRequest(1, [0] * 4), OpenRequest(2, [0] * 4)])
        pool.reserve([ReserveRequest(1, 16), ReserveRequest(2, 16)])
        pool.commit([CommitRequest(1, 4, 4)])  # held at the gate: the next three queue behind it
        assert gated.entered.wait(10)
        pool.commit([CommitRequest(1, 6, 5, [1, 2]), CommitRequest(2, 5, 5, [3])])
        pool.commit([CommitRequest(1, 9, 9, [4, 5, 6])])
        pool.commit([CommitRequest(2, 8, 8, [7, 8, 9])])
        gated.gate.set()
        pool.flush()
        assert gated.commits == [[(1, 4, 4, ())], [(1, 9, 9, [1, 2, 4, 5, 6]), (2, 8, 8, [3, 7, 8, 9])]]
        assert pool.lease_stats.writer.commits_folded == 2
        assert list(gated.inner.get(1).token_ids) == [0] * 4 + [1, 2, 4, 5, 6]

        gated.gate.clear()
        gated.entered.clear()
        gated.commits.clear()
        pool.commit([CommitRequest(1, 10, 10, [10])])  # held
        assert gated.entered.wait(10)
        pool.commit([CommitRequest(1, 11, 9, [11])])  # num_context shrinks: refused
        pool.commit([CommitRequest(2, 12, 12, [12, 13, 14, 15])])  # fine: must still be applied
        gated.gate.set()
        with pytest.raises(InvalidRequest, match="cannot shrink"):
            pool.flush()
        assert gated.commits[0] == [(1, 10, 10, [10])]
        assert gated.commits[-1] == [(2, 12, 12, [12, 13, 14, 15])]
        assert (gated.inner.get(1).num_tokens, gated.inner.get(2).num_tokens) == (10, 12)


def test_a_queued_close_reaches_the_pool_before_an_open_that_needs_its_pages():
    gated = GatedPool(make_manager(num_blocks=2))
    with LeasedPoolControl(gated, lease_tokens=TPB) as pool:
        pool.open([OpenRequest(1, [1] * 8)])  # both blocks
        pool.commit([CommitRequest(1, 1, 1)])  # held at the gate, the close behind it
        assert gated.entered.wait(10)
        pool.close([1])
        threading.Timer(0.05, gated.gate.set).start()
        [opened] = pool.open([OpenRequest(2, [2] * 8)])
        assert sorted(opened.block_table) == [0, 1]
        assert pool.lease_stats.drains == 1


def test_shutdown_sends_everything_queued_and_later_calls_block():
    counting = CountingPool(make_manager())
    pool = LeasedPoolControl(counting, lease_tokens=TPB)
    pool.open([OpenRequest(1, [1, 2])])
    pool.commit([CommitRequest(1, 2, 2)])
    pool.shutdown()
    assert counting.inner.get(1).num_tokens == 2
    pool.close([1])  # no thread left: sent at once
    assert 1 not in counting.inner and counting.calls["close"] == 1


def test_lease_tokens_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="lease_tokens"):
        LeasedPoolControl(make_manager(), lease_tokens=-1)


# ---- over gRPC -----------------------------------------------------------------------------------------


def test_over_grpc_the_same_workload_gives_the_same_tables_and_every_verb_is_counted():
    seed = random.SystemRandom().randrange(2**32)
    behind, layout = make_served(ROOMY)
    bare = make_manager(tokens_per_block=GRPC_TPB)
    with BackgroundServer(behind, layout) as server, MeteredKVPoolClient(server.address) as client:
        with LeasedPoolControl(client, lease_tokens=GRPC_TPB) as leased:
            workload = Workload(random.Random(seed), [(bare, bare), (leased, behind)])
            workload.run(80)
            workload.stats()
        traffic = client.traffic.snapshot()
    for method in ("GetLayout", "Open", "Reserve", "Commit", "Close", "PoolStats"):
        assert traffic[method].calls > 0 and traffic[method].request_bytes >= 0, (seed, method)
    assert traffic["Commit"].request_bytes > 0 and traffic["Open"].response_bytes > 0, seed
    # the wrapper's own count of calls is the wire's (+ 1: the client's GetLayout for the epoch)
    stats = leased.lease_stats
    assert sum(t.calls for t in traffic.values()) == stats.blocking_rpcs + stats.async_rpcs + 1, seed

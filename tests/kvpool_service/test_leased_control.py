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
from collections import Counter

import hypothesis.strategies as st
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from hypothesis import given, settings

from kvpool_service.blocks import BlockManager
from kvpool_service.control import CommitRequest, OpenRequest, PoolControl, ReserveRequest
from kvpool_service.errors import InvalidRequest, LimitExceeded, PoolExhausted, UnknownSequence
from kvpool_service.leased_control import LeasedPoolControl
from kvpool_service.proto import kvpool_pb2 as pb
from kvpool_service.server import BackgroundServer
from kvpool_service.spec import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.traffic import MeteredKVPoolClient, tensor_fields

TPB, MAX_LEN, MAX_SEQS, K = 4, 64, 4, 3
# Big enough that no workload below evicts a cached block, even with every sequence's lease held:
# then leases cannot change which prompts hit the prefix cache.
ROOMY = 4096
BASES = [[7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4], [2, 2, 2, 2, 9, 9, 9, 9, 3, 3]]


def make_manager(num_blocks: int = ROOMY, *, epoch: int = 0, max_model_len: int = MAX_LEN,
                 tokens_per_block: int = TPB) -> BlockManager:
    return BlockManager(num_blocks, tokens_per_block, max_num_seqs=MAX_SEQS, max_model_len=max_model_len,
                        watermark=0.0, epoch=epoch)


class CountingPool:
    """Passes every verb to `inner`, counting calls and keeping the reserve requests sent."""

    def __init__(self, inner: PoolControl):
        self.inner, self.calls, self.reserves = inner, Counter(), []

    def open(self, requests):
        self.calls["open"] += 1
        return self.inner.open(requests)

    def reserve(self, requests):
        self.calls["reserve"] += 1
        self.reserves.append(list(requests))
        return self.inner.reserve(requests)

    def commit(self, requests):
        self.calls["commit"] += 1
        return self.inner.commit(requests)

    def close(self, seq_ids):
        self.calls["close"] += 1
        return self.inner.close(seq_ids)

    def stats(self):
        self.calls["stats"] += 1
        return self.inner.stats()

    def limits(self):
        return self.inner.limits()


# ---- the random workload, run on several pools at once -------------------------------------------


class Workload:
    """A scheduler's calls: open (some prompts re-use closed sequences' tokens), steps that reserve
    to num_computed + K + 1 and commit 1..K+1 accepted tokens with their ids, closes, stats."""

    def __init__(self, rng: random.Random, pools: list[tuple[PoolControl, BlockManager]]):
        self.rng, self.pools = rng, pools
        self.tables: list[dict[int, list[int]]] = [{} for _ in pools]  # the callers' block tables
        self.seqs: dict[int, dict] = {}  # seq_id -> tokens, computed, context, known
        self.finished: list[list[int]] = []
        self.next_id = 0

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            op = self.rng.choices(["open", "step", "close", "stats", "bad"], [3, 10, 2, 1, 1])[0]
            getattr(self, op)()
        self.check_pools()

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.finished and rng.random() < 0.5:
            tokens = rng.choice(self.finished)
            tail = [rng.randrange(10) for _ in range(rng.randint(0, 3))]
            return (tokens[: rng.randint(1, len(tokens))] + tail)[:MAX_LEN]  # a prompt fits max_model_len
        base = rng.choice(BASES)
        return base[: rng.randint(1, len(base))] + [rng.randrange(10) for _ in range(rng.randint(0, 9))]

    def open(self) -> None:
        count = min(self.rng.randint(1, 2), MAX_SEQS - len(self.seqs))
        if count <= 0:
            return
        requests = [OpenRequest(self.next_id + i, self.prompt()) for i in range(count)]
        self.next_id += count
        answers = [pool.open(requests) for pool, _ in self.pools]
        for results in answers[1:]:  # block ids may differ (leases took some), nothing else
            assert [(r.seq_id, r.slot, r.num_cached_tokens, len(r.block_table)) for r in results] == [
                (r.seq_id, r.slot, r.num_cached_tokens, len(r.block_table)) for r in answers[0]]
        for tables, results in zip(self.tables, answers):
            for r in results:
                tables[r.seq_id] = list(r.block_table)
        for request, r in zip(requests, answers[0]):
            prompt = list(request.prompt_token_ids)
            self.seqs[r.seq_id] = {"tokens": prompt, "computed": r.num_cached_tokens,
                                   "context": r.num_cached_tokens, "known": len(prompt)}

    def step(self) -> None:
        if not self.seqs:
            return
        ids = [i for i in self.seqs if self.rng.random() < 0.8] or list(self.seqs)
        wanted = {i: min(self.seqs[i]["computed"] + K + 1, MAX_LEN) for i in ids}
        requests = [ReserveRequest(i, wanted[i]) for i in ids]
        for (pool, _), tables in zip(self.pools, self.tables):
            for i, new_blocks in zip(ids, pool.reserve(requests)):
                tables[i].extend(new_blocks)  # what Scheduler._reserve does
        commits = []
        for i in ids:
            seq = self.seqs[i]
            seq["computed"] = min(seq["computed"] + self.rng.randint(1, K + 1), wanted[i])
            while len(seq["tokens"]) < seq["computed"]:
                seq["tokens"].append(self.rng.randrange(10))
            # the draft context lags a token now and then (it never shrinks)
            seq["context"] = max(seq["context"], seq["computed"] - self.rng.choice([0, 0, 1]))
            new_ids = seq["tokens"][seq["known"]: seq["computed"]]
            seq["known"] = max(seq["known"], seq["computed"])
            commits.append(CommitRequest(i, seq["computed"], seq["context"], new_ids))
        for pool, _ in self.pools:
            pool.commit(commits)
        for i in ids:
            if self.seqs[i]["computed"] >= MAX_LEN:
                self.close_ids([i])

    def close(self) -> None:
        if self.seqs:
            self.close_ids(self.rng.sample(sorted(self.seqs), self.rng.randint(1, min(2, len(self.seqs)))))

    def close_ids(self, ids: list[int]) -> None:
        for pool, _ in self.pools:
            pool.close(ids)
        for tables in self.tables:
            for i in ids:
                del tables[i]
        for i in ids:
            seq = self.seqs.pop(i)
            self.finished.append(seq["tokens"][: seq["known"]])

    def stats(self) -> None:
        usages = [pool.stats() for pool, _ in self.pools]
        for usage in usages[1:]:
            assert (usage.num_seqs, usage.prefix_cache_queries, usage.prefix_cache_hits) == (
                usages[0].num_seqs, usages[0].prefix_cache_queries, usages[0].prefix_cache_hits)
        assert usages[0].num_seqs == len(self.seqs)
        self.check_pools()

    def bad(self) -> None:
        """A call every pool refuses the same way, at once."""
        if self.seqs and self.rng.random() < 0.5:
            request, error = ReserveRequest(min(self.seqs), MAX_LEN + 1), LimitExceeded
        else:
            request, error = ReserveRequest(10_000 + self.next_id, 4), UnknownSequence
        for pool, _ in self.pools:
            with pytest.raises(error):
                pool.reserve([request])

    def check_pools(self) -> None:
        for pool, _ in self.pools:
            if isinstance(pool, LeasedPoolControl):
                pool.flush()
        for (_, manager), tables in zip(self.pools, self.tables):
            assert sorted(tables) == sorted(self.seqs)
            for i, table in tables.items():
                assert table == manager.get(i).block_table, f"sequence {i}: caller's table != pool's"
        reference = self.pools[0][1]
        for _, manager in self.pools[1:]:
            for i in self.seqs:
                mine, theirs = manager.get(i), reference.get(i)
                assert (mine.num_tokens, mine.num_context, list(mine.token_ids), mine.num_hashed_blocks) == (
                    theirs.num_tokens, theirs.num_context, list(theirs.token_ids), theirs.num_hashed_blocks)


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


GRPC_TPB = 16  # a PoolSpec's least


def make_served(num_blocks: int) -> tuple[BlockManager, PoolLayout]:
    spec = PoolSpec(
        target=LayerGroup(name="target", num_layers=1, num_kv_heads=2, head_dim=16, dtype="bfloat16"),
        draft=LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=16, dtype="bfloat16"),
        tokens_per_block=GRPC_TPB)
    layout = PoolLayout.create(spec, num_blocks)
    return make_manager(num_blocks, epoch=layout.epoch, tokens_per_block=GRPC_TPB), layout


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


def test_the_counter_counts_serialized_protobuf_bytes():
    manager, layout = make_served(16)
    with BackgroundServer(manager, layout) as server, MeteredKVPoolClient(server.address) as client:
        client.open([OpenRequest(3, [1, 2, 3])])
        client.traffic.reset()
        assert client.reserve([ReserveRequest(3, 40)]) == [[1, 2]]
        expected_request = pb.ReserveRequest(epoch=layout.epoch, seq_ids=[3], lengths=[40])
        expected_response = pb.ReserveResponse(num_new_blocks=[2], block_ids=[1, 2])
        assert client.traffic.snapshot() == {
            "Reserve": (1, expected_request.ByteSize(), expected_response.ByteSize())}
        with pytest.raises(UnknownSequence):
            client.commit([CommitRequest(4, 1, 1)])
        assert client.traffic.snapshot()["Commit"][0::2] == (1, 0)  # refused: no response bytes


def test_no_field_of_the_kvpool_proto_can_carry_a_tensor():
    assert tensor_fields(pb.DESCRIPTOR) == []


def test_tensor_fields_finds_bytes_and_float_arrays():
    proto = descriptor_pb2.FileDescriptorProto(name="probe.proto", package="probe", syntax="proto3")
    message = proto.message_type.add(name="Leaky")
    F = descriptor_pb2.FieldDescriptorProto
    message.field.add(name="ok", number=1, type=F.TYPE_UINT32, label=F.LABEL_REPEATED)
    message.field.add(name="scale", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    message.field.add(name="blob", number=3, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    inner = message.nested_type.add(name="Inner")
    inner.field.add(name="values", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_REPEATED)
    file = descriptor_pool.DescriptorPool().Add(proto)
    assert sorted(tensor_fields(file)) == ["probe.Leaky.Inner.values", "probe.Leaky.blob"]

"""KVPoolClient: the same PoolControl as the in-process BlockManager, with deadlines and typed errors.

The `pool` fixture gives either implementation; every test that takes it runs against both, with
the same hand-computed expectations. That is the contract the engine relies on.
"""

from __future__ import annotations

import socket
import time

import pytest

from kvpool_service.block_manager import BlockManager
from kvpool_service.client import KVPoolClient
from kvpool_service.control import CommitRequest, OpenRequest, PoolControl, ReserveRequest
from kvpool_service.errors import (
    InvalidRequest,
    LimitExceeded,
    PoolExhausted,
    StaleEpoch,
    TransportError,
    UnknownSequence,
)
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.server import BackgroundServer

TPB = 16


def make_layout(num_blocks=12) -> PoolLayout:
    spec = PoolSpec(
        target=LayerGroup(name="target", num_layers=1, num_kv_heads=2, head_dim=16, dtype="bfloat16"),
        draft=LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=16, dtype="bfloat16"),
        tokens_per_block=TPB)
    return PoolLayout.create(spec, num_blocks)


def make_blocks(layout: PoolLayout) -> BlockManager:
    return BlockManager.from_layout(layout, max_num_seqs=3, max_model_len=128, watermark=0.0)


@pytest.fixture(params=["in-process", "remote"])
def pool(request):
    layout = make_layout()
    blocks = make_blocks(layout)
    if request.param == "in-process":
        yield blocks
        return
    with BackgroundServer(blocks, layout) as server, KVPoolClient(server.address) as client:
        yield client


def test_both_pools_are_pool_controls(pool):
    assert isinstance(pool, PoolControl)


def test_open_reserve_commit_close_give_the_same_answers(pool):
    prompt = list(range(40))
    [a] = pool.open([OpenRequest(10, prompt)])
    assert (a.seq_id, a.seq_index, a.num_cached_tokens, len(a.block_table)) == (10, 0, 0, 3)
    [grown] = pool.reserve([ReserveRequest(10, 70)])
    assert len(grown) == 2 and not set(grown) & set(a.block_table)  # ceil(70 / 16) = 5 blocks
    assert pool.reserve([ReserveRequest(10, 33)]) == [[]]  # capacities never shrink
    pool.commit([CommitRequest(10, 45, 41, [40, 41, 42, 43, 44])])
    [b] = pool.open([OpenRequest(11, prompt)])  # blocks 0 and 1 (32 tokens) are full and written
    assert (b.seq_index, b.num_cached_tokens, b.block_table[:2]) == (1, 32, a.block_table[:2])
    usage = pool.stats()
    assert (usage.num_seqs, usage.num_used_blocks, usage.prefix_cache_hits, usage.prefix_cache_queries) == (
        2, 6, 32, 80)
    pool.close([10, 11])
    usage = pool.stats()
    assert (usage.num_seqs, usage.num_used_blocks, usage.num_cached_blocks) == (0, 0, 2)


def test_refusals_raise_the_same_typed_errors(pool):
    pool.open([OpenRequest(1, [1, 2, 3])])
    with pytest.raises(UnknownSequence):
        pool.reserve([ReserveRequest(2, 8)])
    with pytest.raises(InvalidRequest, match="num_context 3 > num_tokens 2"):
        pool.commit([CommitRequest(1, 2, 3)])
    with pytest.raises(LimitExceeded, match="max_model_len is 128"):
        pool.reserve([ReserveRequest(1, 129)])
    with pytest.raises(InvalidRequest):
        pool.open([OpenRequest(-5, [1])])
    with pytest.raises(PoolExhausted) as info:  # 3 sequences, 12 blocks: 2 x 7 more do not fit in 11
        pool.open([OpenRequest(2, [1] * 112), OpenRequest(3, [1] * 112)])
    assert (info.value.resource, info.value.needed, info.value.available, info.value.shortfall) == (
        "blocks", 14, 11, 3)
    pool.open([OpenRequest(2, [1]), OpenRequest(3, [1])])
    with pytest.raises(PoolExhausted, match="sequence indices") as info:  # all 3 taken
        pool.open([OpenRequest(4, [1])])
    assert (info.value.resource, info.value.needed, info.value.available) == ("sequences", 1, 0)
    assert pool.stats().num_seqs == 3


def test_a_restarted_pool_refuses_the_old_epoch_until_the_client_reconnects():
    first = make_layout()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with BackgroundServer(make_blocks(first), first, port=port) as server:
        client = KVPoolClient(server.address)
        client.open([OpenRequest(1, [1])])
    second = make_layout()
    with BackgroundServer(make_blocks(second), second, port=port):
        with pytest.raises(StaleEpoch, match="fetch the layout again"):
            client.open([OpenRequest(1, [1])])
        assert client.connect().epoch == second.epoch
        [result] = client.open([OpenRequest(1, [1])])
        assert result.seq_index == 0
    client.shutdown()


def test_every_call_has_a_deadline():
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        client = KVPoolClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.3)
        start = time.monotonic()
        with pytest.raises(TransportError) as info:
            client.stats()
        assert info.value.code == "DEADLINE_EXCEEDED"
        assert 0.25 < time.monotonic() - start < 5
        client.shutdown()


def test_unreachable_pool_is_a_transport_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again when the block ends: nothing listens
    with KVPoolClient(f"127.0.0.1:{port}", timeout=2) as client, pytest.raises(TransportError) as info:
        client.reserve([ReserveRequest(1, 1)])
    assert info.value.code == "UNAVAILABLE"


def test_token_is_sent_when_given():
    layout = make_layout()
    with BackgroundServer(make_blocks(layout), layout, token="abc") as server:
        with KVPoolClient(server.address, token="abc") as client:
            assert client.health() == "SERVING" and client.stats().num_blocks == 12
        with KVPoolClient(server.address) as client:
            assert client.health() == "SERVING"  # health needs no token
            assert client.health("no.such.Service") == "SERVICE_UNKNOWN"
            with pytest.raises(TransportError, match="missing bearer token") as info:
                client.stats()
            assert info.value.code == "UNAUTHENTICATED"


def test_values_the_wire_cannot_carry_are_refused_before_sending():
    with KVPoolClient("127.0.0.1:1", timeout=0.5) as client:
        client._epoch = 7  # no server: a refusal here proves nothing was sent
        with pytest.raises(InvalidRequest, match="reserve request cannot be sent"):
            client.reserve([ReserveRequest(1, -1)])
        with pytest.raises(InvalidRequest, match="commit request cannot be sent"):
            client.commit([CommitRequest(1, 2.5, 1)])
        with pytest.raises(InvalidRequest, match="open request cannot be sent"):
            client.open([OpenRequest(1, [2**32])])


def test_client_rejects_a_bad_address_or_timeout():
    with pytest.raises(ValueError, match="host:port"):
        KVPoolClient("localhost")
    with pytest.raises(ValueError, match="timeout must be positive"):
        KVPoolClient("127.0.0.1:1", timeout=0)


def test_limits_are_the_same_in_process_and_over_the_wire():
    layout = make_layout(num_blocks=50)
    blocks = BlockManager.from_layout(layout, max_num_seqs=3, max_model_len=128, watermark=0.1)
    with BackgroundServer(blocks, layout) as server, KVPoolClient(server.address) as client:
        # 5 of the 50 blocks are held back for growth: one sequence may hold 45
        assert client.limits() == blocks.limits() == (50, TPB, 3, 128, 45)
    assert blocks.limits().blocks_for(TPB + 1) == 2

"""The gRPC servicer against a real server on loopback: status codes, auth, health, reflection, layout.

Raw stubs are used on purpose: they can send what the client never would (epoch 0, ragged arrays,
bytes that are not a protobuf message).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvpool_service.block_manager import BlockManager
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.proto import kvpool_pb2 as pb
from kvpool_service.proto import kvpool_pb2_grpc
from kvpool_service.server import SERVICE_NAME, BackgroundServer

TPB = 16
TOKEN = "s3cret-token"


def make_layout(num_blocks=24) -> PoolLayout:
    spec = PoolSpec(
        target=LayerGroup(name="target", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16"),
        draft=LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=32, dtype="float8_e4m3fn"),
        tokens_per_block=TPB)
    return PoolLayout.create(spec, num_blocks)


@dataclass
class Served:
    server: BackgroundServer
    blocks: BlockManager
    layout: PoolLayout
    channel: grpc.Channel
    stub: kvpool_pb2_grpc.KVPoolStub
    md: tuple | None  # the metadata every call carries (the bearer token when auth is on)


@pytest.fixture(params=[None, TOKEN], ids=["auth-off", "auth-on"])
def served(request):
    layout = make_layout()
    blocks = BlockManager.from_layout(layout, max_num_seqs=4, max_model_len=128, watermark=0.0)
    with BackgroundServer(blocks, layout, token=request.param) as server:
        channel = grpc.insecure_channel(server.address)
        md = (("authorization", f"Bearer {request.param}"),) if request.param else None
        yield Served(server, blocks, layout, channel, kvpool_pb2_grpc.KVPoolStub(channel), md)
        channel.close()


def snapshot(blocks: BlockManager):
    return (blocks.stats(), blocks.free_block_ids(), blocks.cached_block_ids(),
            {s: list(blocks.get(s).block_table) for s in list(blocks._seqs)})


def rejected(call, request, metadata):
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=5, metadata=metadata)
    return info.value.code(), info.value.details()


def test_every_refusal_has_its_status_code_and_a_message_and_changes_nothing(served):
    blocks, stub, md, epoch = served.blocks, served.stub, served.md, served.layout.epoch
    stub.Open(pb.OpenRequest(epoch=epoch, sequences=[pb.SequencePrompt(seq_id=1, prompt_token_ids=[1] * 20)]),
              timeout=5, metadata=md)
    before = snapshot(blocks)
    prompt = pb.SequencePrompt
    cases = [
        (stub.Reserve, pb.ReserveRequest(seq_ids=[1], lengths=[40]), grpc.StatusCode.INVALID_ARGUMENT,
         "epoch is required"),
        (stub.Reserve, pb.ReserveRequest(epoch=epoch, seq_ids=[1], lengths=[40, 50]),
         grpc.StatusCode.INVALID_ARGUMENT, "seq_ids has 1, lengths has 2"),
        (stub.Commit, pb.CommitRequest(epoch=epoch, seq_ids=[1], num_tokens=[4], num_context=[4],
                                       num_new_token_ids=[2], token_ids=[7]),
         grpc.StatusCode.INVALID_ARGUMENT, "summing to the 1 token_ids"),
        (stub.Commit, pb.CommitRequest(epoch=epoch, seq_ids=[1], num_tokens=[4], num_context=[5]),
         grpc.StatusCode.INVALID_ARGUMENT, "num_context 5 > num_tokens 4"),
        (stub.Open, pb.OpenRequest(epoch=epoch, sequences=[prompt(seq_id=2)]),
         grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
        (stub.Open, pb.OpenRequest(epoch=epoch, sequences=[prompt(seq_id=2, prompt_token_ids=[1] * 129)]),
         grpc.StatusCode.OUT_OF_RANGE, "max_model_len is 128"),
        (stub.Open, pb.OpenRequest(epoch=epoch, sequences=[prompt(seq_id=9 + i, prompt_token_ids=[1])
                                                           for i in range(5)]),
         grpc.StatusCode.OUT_OF_RANGE, "max_num_seqs is 4"),
        (stub.Reserve, pb.ReserveRequest(epoch=epoch, seq_ids=[1], lengths=[129]),
         grpc.StatusCode.OUT_OF_RANGE, "asks for 129 positions"),
        (stub.Reserve, pb.ReserveRequest(epoch=epoch, seq_ids=[1, 3], lengths=[40, 40]),
         grpc.StatusCode.NOT_FOUND, "sequence 3 is not open"),
        (stub.Close, pb.CloseRequest(epoch=epoch ^ 1, seq_ids=[1]), grpc.StatusCode.FAILED_PRECONDITION,
         "fetch the layout again"),
    ]
    for call, request, code, words in cases:
        got_code, details = rejected(call, request, md)
        assert got_code == code and words in details, (code, words, got_code, details)
        assert snapshot(blocks) == before


def test_out_of_blocks_is_resource_exhausted_with_counts_in_trailing_metadata(served):
    blocks, layout, stub, md = served.blocks, served.layout, served.stub, served.md
    ids = [1, 2, 3, 4]
    stub.Open(pb.OpenRequest(epoch=layout.epoch, sequences=[
        pb.SequencePrompt(seq_id=i, prompt_token_ids=[i]) for i in ids]), timeout=5, metadata=md)
    before = snapshot(blocks)
    with pytest.raises(grpc.RpcError) as info:  # 4 x 7 more blocks; 24 - 4 = 20 are left
        stub.Reserve(pb.ReserveRequest(epoch=layout.epoch, seq_ids=ids, lengths=[128] * 4), timeout=5,
                     metadata=md)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reserve needs 28 blocks; 20 are available" in error.details()
    trailing = dict(error.trailing_metadata())
    assert (trailing["dflash-resource"], trailing["dflash-needed"], trailing["dflash-available"]) == (
        "blocks", "28", "20")
    assert snapshot(blocks) == before


def test_bytes_that_are_not_a_message_are_invalid_argument(served):
    blocks, md = served.blocks, served.md
    before = snapshot(blocks)
    raw = served.channel.unary_unary(f"/{SERVICE_NAME}/Reserve")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff", timeout=5, metadata=md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf" in info.value.details()
    assert snapshot(blocks) == before


def test_auth_is_required_when_a_token_is_set_except_for_health(served):
    stub, md = served.stub, served.md
    health = health_pb2_grpc.HealthStub(served.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING  # no metadata: probes carry none
    if md is None:
        assert stub.PoolStats(pb.PoolStatsRequest(), timeout=5).num_seqs == 0
        return
    for metadata, words in ((None, "missing bearer token"), ((("authorization", "Bearer nope"),), "wrong"),
                            ((("authorization", TOKEN),), "wrong")):
        code, details = rejected(stub.PoolStats, pb.PoolStatsRequest(), metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED and words in details
    assert stub.PoolStats(pb.PoolStatsRequest(), timeout=5, metadata=md).num_seqs == 0


def test_reflection_lists_the_services_behind_auth(served):
    database = ProtoReflectionDescriptorDatabase(served.channel)  # sends no token
    if served.md is not None:  # reflection sits behind auth like every service but health
        with pytest.raises(grpc.RpcError) as info:
            database.get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        return
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(database.get_services())
    assert database.FindFileContainingSymbol(SERVICE_NAME).name == "dflash/kvpool/v1/kvpool.proto"


def test_layout_and_stats_describe_the_pool(served):
    layout, stub, md = served.layout, served.stub, served.md
    got = stub.GetLayout(pb.GetLayoutRequest(), timeout=5, metadata=md)
    assert (got.epoch, got.tokens_per_block, got.num_blocks, got.max_num_seqs, got.max_model_len) == (
        layout.epoch, TPB, 24, 4, 128)
    # target: 2 layers x 2 heads x 16 x 2 (K, V) x 2 bytes; draft fp8: 1 x 1 x 32 x 2 x 1
    assert [(g.name, g.dtype, g.bytes_per_token) for g in got.groups] == [
        ("target", "bfloat16", 256), ("draft", "float8_e4m3fn", 64)]
    assert got.bytes_per_token == 320
    tokens = list(range(40))
    for seq_id in (1, 2):
        stub.Open(pb.OpenRequest(epoch=layout.epoch, sequences=[
            pb.SequencePrompt(seq_id=seq_id, prompt_token_ids=tokens)]), timeout=5, metadata=md)
        stub.Commit(pb.CommitRequest(epoch=layout.epoch, seq_ids=[seq_id], num_tokens=[40],
                                     num_context=[40]), timeout=5, metadata=md)
    stats = stub.PoolStats(pb.PoolStatsRequest(), timeout=5, metadata=md)
    # The second open hit the first's two full blocks: 32 of 80 prompt tokens; 3 + 1 blocks in use.
    assert (stats.num_seqs, stats.prefix_cache_hits, stats.prefix_cache_queries) == (2, 32, 80)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)
    assert [(g.name, g.num_blocks, g.num_used_blocks, g.num_free_blocks, g.num_cached_blocks)
            for g in stats.groups] == [("target", 24, 4, 20, 0), ("draft", 24, 4, 20, 0)]
    assert stats.epoch == layout.epoch and stats.uptime_s > 0


def test_binds_loopback_by_default(served):
    assert served.server.address.startswith("127.0.0.1:") and served.server.server.port > 0


def test_server_refuses_a_block_manager_of_another_epoch():
    layout = make_layout()
    blocks = BlockManager(24, TPB, max_num_seqs=2, max_model_len=64, epoch=layout.epoch + 1)
    with pytest.raises(ValueError, match="is not the layout's"):
        BackgroundServer(blocks, layout).start()


def test_a_read_only_server_reports_but_refuses_every_change():
    from kvpool_service.client import KVPoolClient
    from kvpool_service.control import OpenRequest
    from kvpool_service.errors import ReadOnly

    layout = make_layout()
    blocks = BlockManager.from_layout(layout, max_num_seqs=4, max_model_len=128, watermark=0.0)
    blocks.open([OpenRequest(1, list(range(40)))])  # the engine's own sequence
    with BackgroundServer(blocks, layout, read_only=True) as server, KVPoolClient(server.address) as client:
        assert client.stats().num_seqs == 1 and client.limits() == blocks.limits()
        with pytest.raises(ReadOnly, match="read-only"):
            client.open([OpenRequest(2, [1, 2, 3])])
        with pytest.raises(ReadOnly, match="read-only"):
            client.close([1])
    assert len(blocks) == 1  # nothing changed

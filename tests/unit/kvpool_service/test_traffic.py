"""What the pool's control plane puts on the wire: `TrafficCounter` counts serialized protobuf bytes
per RPC, against protos built here; `tensor_fields` finds every field a tensor could travel in, and
the kvpool proto has none."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from pool_workload import make_served

from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import UnknownSequence
from kvpool_service.metered_client import MeteredKVPoolClient, tensor_fields
from kvpool_service.proto import kvpool_pb2 as pb
from kvpool_service.server import BackgroundServer


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

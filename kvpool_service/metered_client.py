"""What the pool's control plane puts on the wire: bytes counted per RPC, and no field a tensor fits in.

`TrafficCounter` is a client interceptor that adds up, per method, the calls and the serialized
protobuf sizes (`ByteSize()`) of requests and responses. That is the payload only: gRPC adds a
5-byte frame header per message, and HTTP/2 its (HPACK-compressed) headers per call.
`MeteredKVPoolClient` is a `KVPoolClient` whose calls go through one.

`tensor_fields` is the other half of "no tensor bytes over gRPC": it lists every field of a proto
file that could carry tensor data (`bytes`, or repeated float / double). For kvpool.proto the list
is empty, so whatever the counter counts is ids and lengths.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from kvpool_service.client import KVPoolClient
from kvpool_service.proto import kvpool_pb2


class MethodTraffic(NamedTuple):
    calls: int
    request_bytes: int
    response_bytes: int  # 0 for a call that failed


class TrafficCounter(grpc.UnaryUnaryClientInterceptor):
    """Calls and payload bytes per method name ("Reserve", "Commit", ...), from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_method: dict[str, MethodTraffic] = {}

    def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = (method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1]
        sent = request.ByteSize()
        outcome = continuation(client_call_details, request)
        try:
            received = outcome.result().ByteSize()
        except Exception:  # the call failed: the caller sees the error from the outcome it gets back
            received = 0
        with self._lock:
            calls, request_bytes, response_bytes = self._by_method.get(method, (0, 0, 0))
            self._by_method[method] = MethodTraffic(calls + 1, request_bytes + sent,
                                                    response_bytes + received)
        return outcome

    def snapshot(self) -> dict[str, MethodTraffic]:
        with self._lock:
            return dict(self._by_method)

    def reset(self) -> None:
        with self._lock:
            self._by_method.clear()


class MeteredKVPoolClient(KVPoolClient):
    """A KVPoolClient whose every call is counted by `traffic`."""

    def __init__(self, address: str, *, traffic: TrafficCounter | None = None, **kwargs):
        self.traffic = traffic if traffic is not None else TrafficCounter()
        super().__init__(address, interceptors=[self.traffic], **kwargs)

    def traffic_totals(self) -> dict[str, int]:
        """Calls and payload bytes over every method so far."""
        methods = self.traffic.snapshot().values()
        return {"calls": sum(m.calls for m in methods),
                "request_bytes": sum(m.request_bytes for m in methods),
                "response_bytes": sum(m.response_bytes for m in methods)}


def tensor_fields(file: FileDescriptor = kvpool_pb2.DESCRIPTOR) -> list[str]:
    """Full names of the fields of `file`'s messages that could carry tensor data: `bytes` fields,
    and repeated float or double fields."""
    found: list[str] = []

    def walk(message: Descriptor) -> None:
        for field in message.fields:
            floating = field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
            if field.type == FieldDescriptor.TYPE_BYTES or (floating and _is_repeated(field)):
                found.append(field.full_name)
        for nested in message.nested_types:
            walk(nested)

    for message in file.message_types_by_name.values():
        walk(message)
    return found


def _is_repeated(field: FieldDescriptor) -> bool:
    # protobuf 5+ has `is_repeated`; `label` is deprecated there.
    is_repeated = getattr(field, "is_repeated", None)
    return is_repeated if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED

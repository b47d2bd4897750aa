"""The scheduler's pool over gRPC: a `PoolControl` with a deadline on every call.

Status codes come back as the same typed errors the in-process BlockManager raises (RESOURCE_EXHAUSTED
-> PoolExhausted with `needed` / `available` from the trailing metadata, NOT_FOUND -> UnknownSequence,
...), so the engine handles both pools with one `except`. Calls that reach no decision (unavailable,
deadline exceeded, unauthenticated) raise TransportError. Mutations carry the epoch read from
GetLayout on first use; after the pool restarts they fail with StaleEpoch until `connect()`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool_service.control import (
    CommitRequest,
    OpenRequest,
    OpenResult,
    PoolLimits,
    PoolUsage,
    ReserveRequest,
)
from kvpool_service.errors import (
    AVAILABLE_KEY,
    NEEDED_KEY,
    RESOURCE_KEY,
    STATUS_NAMES,
    InvalidRequest,
    PoolExhausted,
    TransportError,
    UnknownSequence,
)
from kvpool_service.proto import kvpool_pb2 as pb
from kvpool_service.proto import kvpool_pb2_grpc

DEFAULT_TIMEOUT_S = 5.0
MAX_MESSAGE = 2**31 - 1
_ERROR_OF_CODE = {getattr(grpc.StatusCode, name): cls for cls, name in STATUS_NAMES.items()}


def _typed_error(error: grpc.RpcError) -> Exception:
    code, details = error.code(), error.details() or ""
    cls = _ERROR_OF_CODE.get(code)
    if cls is PoolExhausted:
        trailing = dict(error.trailing_metadata() or ())
        return PoolExhausted(details, needed=int(trailing.get(NEEDED_KEY, 0)),
                             available=int(trailing.get(AVAILABLE_KEY, 0)),
                             resource=trailing.get(RESOURCE_KEY, "blocks"))
    if cls is not None:
        return cls(details)
    return TransportError(f"{code.name}: {details}", code=code.name)


def _encode(build, what: str):
    """Build a request proto; values the wire cannot carry (negative, too large, not ints) are named."""
    try:
        return build()
    except (TypeError, ValueError) as error:
        raise InvalidRequest(f"{what} cannot be sent: {error}") from None


class KVPoolClient:
    """A remote pool at `address` ("host:port"). Not thread-safe: one thread at a time may call it
    (one scheduler owns one client; `LeasedPoolControl` hands it between its two threads in turn).

    interceptors: gRPC client interceptors every call goes through (`metered_client.TrafficCounter`).
    """

    def __init__(self, address: str, *, token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()):
        if not address or ":" not in address:
            raise ValueError(f"address must be host:port, got {address!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.address, self.timeout = address, timeout
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])
        if interceptors:
            self._channel = grpc.intercept_channel(self._channel, *interceptors)
        self._stub = kvpool_pb2_grpc.KVPoolStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._epoch: int | None = None

    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout,
                          metadata=self._metadata)
        except grpc.RpcError as error:
            raise _typed_error(error) from None

    # ---- layout and admin -------------------------------------------------------------------------

    def connect(self, timeout: float | None = None) -> pb.Layout:
        """Read the layout and adopt its epoch (again, after the pool restarted)."""
        layout = self._call(self._stub.GetLayout, pb.GetLayoutRequest(), timeout)
        self._epoch = layout.epoch
        return layout

    def layout(self, timeout: float | None = None) -> pb.Layout:
        return self._call(self._stub.GetLayout, pb.GetLayoutRequest(), timeout)

    @property
    def epoch(self) -> int:
        if self._epoch is None:
            self.connect()
        return self._epoch

    def pool_stats(self, timeout: float | None = None) -> pb.PoolStatsResponse:
        return self._call(self._stub.PoolStats, pb.PoolStatsRequest(), timeout)

    def stats(self, timeout: float | None = None) -> PoolUsage:
        response = self.pool_stats(timeout)
        group = response.groups[0]  # block counts are the pool's, the same in every group
        return PoolUsage(
            num_blocks=group.num_blocks, num_free_blocks=group.num_free_blocks,
            num_cached_blocks=group.num_cached_blocks, num_used_blocks=group.num_used_blocks,
            num_seqs=response.num_seqs, prefix_cache_queries=response.prefix_cache_queries,
            prefix_cache_hits=response.prefix_cache_hits)

    def limits(self, timeout: float | None = None) -> PoolLimits:
        layout = self.layout(timeout)
        return PoolLimits(layout.num_blocks, layout.tokens_per_block, layout.max_num_seqs,
                          layout.max_model_len, layout.num_blocks - layout.watermark_blocks)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The serving status name of `service` ("" = the whole server): SERVING, NOT_SERVING, ..."""
        try:
            response = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        except UnknownSequence:  # NOT_FOUND from the health service: it does not know `service`
            return "SERVICE_UNKNOWN"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    # ---- the scheduler's verbs --------------------------------------------------------------------

    def open(self, requests: Sequence[OpenRequest], timeout: float | None = None) -> list[OpenResult]:
        request = _encode(lambda: pb.OpenRequest(epoch=self.epoch, sequences=[
            pb.SequencePrompt(seq_id=seq_id, prompt_token_ids=prompt) for seq_id, prompt in requests]),
            "open request")
        response = self._call(self._stub.Open, request, timeout)
        return [OpenResult(s.seq_id, s.seq_index, s.num_cached_tokens, list(s.block_table))
                for s in response.sequences]

    def reserve(self, requests: Sequence[ReserveRequest], timeout: float | None = None) -> list[list[int]]:
        request = _encode(lambda: pb.ReserveRequest(epoch=self.epoch, seq_ids=[r[0] for r in requests],
                                                    lengths=[r[1] for r in requests]), "reserve request")
        response = self._call(self._stub.Reserve, request, timeout)
        counts, block_ids = list(response.num_new_blocks), list(response.block_ids)  # lists slice fast
        return [block_ids[stop - n:stop] for n, stop in zip(counts, itertools.accumulate(counts))]

    def commit(self, requests: Sequence[CommitRequest], timeout: float | None = None) -> None:
        def build():
            counts = [len(r.token_ids) for r in requests]
            token_ids = list(itertools.chain.from_iterable(r.token_ids for r in requests))
            return pb.CommitRequest(
                epoch=self.epoch, seq_ids=[r.seq_id for r in requests],
                num_tokens=[r.num_tokens for r in requests], num_context=[r.num_context for r in requests],
                num_new_token_ids=counts if token_ids else (), token_ids=token_ids)  # no ids: neither array
        self._call(self._stub.Commit, _encode(build, "commit request"), timeout)

    def close(self, seq_ids: Sequence[int], timeout: float | None = None) -> None:
        request = _encode(lambda: pb.CloseRequest(epoch=self.epoch, seq_ids=list(seq_ids)), "close request")
        self._call(self._stub.Close, request, timeout)

    # ---- the channel ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the channel (not a pool verb: `close` releases sequences)."""
        self._channel.close()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

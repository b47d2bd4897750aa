"""The KV pool's gRPC control plane: a `grpc.aio` servicer, thin over one BlockManager.

Each RPC converts the proto, makes one BlockManager call and converts back. The handlers never
await, and the event loop runs one at a time, so calls are serialized without a lock and each is
all-or-nothing, as the BlockManager's are. Two interceptors sit in front:
  - `BearerTokenAuth` (when a token is configured): `authorization: Bearer <token>` on every call
    except the health service's, which Kubernetes probes call without credentials;
  - `_StatusMapper`: every typed error becomes its status code (kvpool_service.errors.STATUS_NAMES)
    with its one-sentence message; unreadable request bytes become INVALID_ARGUMENT. An unexpected
    exception is a bug and reported as INTERNAL.
The standard health service and server reflection are on. The server binds 127.0.0.1 by default.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool_service.block_manager import BlockManager
from kvpool_service.control import OpenRequest
from kvpool_service.errors import (
    AVAILABLE_KEY,
    NEEDED_KEY,
    RESOURCE_KEY,
    STATUS_NAMES,
    InvalidRequest,
    PoolError,
    PoolExhausted,
    ReadOnly,
)
from kvpool_service.geometry import PoolLayout
from kvpool_service.proto import kvpool_pb2 as pb
from kvpool_service.proto import kvpool_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVPool"].full_name  # "dflash.kvpool.v1.KVPool"
HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class KVPoolServicer(kvpool_pb2_grpc.KVPoolServicer):
    """proto -> one BlockManager call -> proto. Typed errors pass through to `_StatusMapper`."""

    def __init__(self, blocks: BlockManager, layout: PoolLayout, *, read_only: bool = False):
        self.blocks = blocks
        self.layout = layout
        self.read_only = read_only
        self.started_at = time.monotonic()

    def _check_epoch(self, epoch: int) -> None:
        if self.read_only:
            raise ReadOnly("this pool's control plane is read-only (admin): its engine owns the block tables")
        if epoch == 0:
            raise InvalidRequest("epoch is required on calls that change the pool; read it from GetLayout")
        self.blocks.check_epoch(epoch)

    async def Open(self, request: pb.OpenRequest, context) -> pb.OpenResponse:
        self._check_epoch(request.epoch)
        results = self.blocks.open([OpenRequest(s.seq_id, s.prompt_token_ids) for s in request.sequences])
        return pb.OpenResponse(sequences=[
            pb.OpenedSequence(seq_id=r.seq_id, seq_index=r.seq_index, num_cached_tokens=r.num_cached_tokens,
                              block_table=r.block_table) for r in results])

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        self._check_epoch(request.epoch)
        _check_parallel(request, "seq_ids", "lengths")
        # Plain (seq_id, length) tuples: a ReserveRequest is one, and lists iterate faster than protos.
        appended = self.blocks.reserve(list(zip(list(request.seq_ids), list(request.lengths))))
        return pb.ReserveResponse(num_new_blocks=[len(new) for new in appended],
                                  block_ids=list(itertools.chain.from_iterable(appended)))

    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        self._check_epoch(request.epoch)
        _check_parallel(request, "seq_ids", "num_tokens", "num_context")
        self.blocks.commit(_commit_requests(request))
        return pb.CommitResponse()

    async def Close(self, request: pb.CloseRequest, context) -> pb.CloseResponse:
        self._check_epoch(request.epoch)
        self.blocks.close(list(request.seq_ids))
        return pb.CloseResponse()

    async def GetLayout(self, request: pb.GetLayoutRequest, context) -> pb.Layout:
        spec = self.layout.spec
        groups = [pb.LayerGroup(name=g.name, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                head_dim=g.head_dim, dtype=g.dtype, bytes_per_token=g.bytes_per_token)
                  for g in spec.groups]
        return pb.Layout(epoch=self.layout.epoch, tokens_per_block=spec.tokens_per_block,
                         num_blocks=self.layout.num_blocks, groups=groups,
                         bytes_per_token=spec.bytes_per_token, max_num_seqs=self.blocks.max_num_seqs,
                         max_model_len=self.blocks.max_model_len,
                         watermark_blocks=self.blocks.watermark_blocks)

    async def PoolStats(self, request: pb.PoolStatsRequest, context) -> pb.PoolStatsResponse:
        u = self.blocks.stats()
        groups = [pb.GroupStats(name=g.name, num_blocks=u.num_blocks, num_free_blocks=u.num_free_blocks,
                                num_cached_blocks=u.num_cached_blocks, num_used_blocks=u.num_used_blocks,
                                bytes_per_token=g.bytes_per_token) for g in self.layout.spec.groups]
        return pb.PoolStatsResponse(
            groups=groups, tokens_per_block=self.layout.spec.tokens_per_block, num_seqs=u.num_seqs,
            prefix_cache_hit_rate=u.prefix_cache_hit_rate, prefix_cache_queries=u.prefix_cache_queries,
            prefix_cache_hits=u.prefix_cache_hits, epoch=self.layout.epoch,
            uptime_s=time.monotonic() - self.started_at)


def _check_parallel(request, *fields: str) -> None:
    lengths = {name: len(getattr(request, name)) for name in fields}
    if len(set(lengths.values())) > 1:
        sizes = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise InvalidRequest(f"the per-sequence arrays must have one entry per sequence: {sizes}")


def _commit_requests(request: pb.CommitRequest) -> list[tuple]:
    """Split the back-to-back token ids by num_new_token_ids (both empty: no new ids)."""
    # Repeated fields copied to lists first, and plain tuples in CommitRequest's field order: iterating
    # and slicing lists, and building tuples, is several times cheaper than the proto containers.
    seq_ids, num_tokens = list(request.seq_ids), list(request.num_tokens)
    num_context = list(request.num_context)
    counts, token_ids = list(request.num_new_token_ids), list(request.token_ids)
    if not counts:
        if token_ids:
            raise InvalidRequest("token_ids were sent without num_new_token_ids to split them")
        return list(zip(seq_ids, num_tokens, num_context, [()] * len(seq_ids)))
    if len(counts) != len(seq_ids) or sum(counts) != len(token_ids):
        raise InvalidRequest(f"num_new_token_ids must have {len(seq_ids)} entries summing to the "
                             f"{len(token_ids)} token_ids; it has {len(counts)} summing to {sum(counts)}")
    stops = itertools.accumulate(counts)
    return [(s, t, c, token_ids[stop - count:stop])
            for s, t, c, count, stop in zip(seq_ids, num_tokens, num_context, counts, stops)]


_UNREADABLE = object()


def _readable(deserialize):
    """A deserializer that reports bad bytes as a value, so the handler can answer INVALID_ARGUMENT."""
    def read(data: bytes):
        try:
            return deserialize(data)
        except Exception:
            return _UNREADABLE
    return read


class _StatusMapper(grpc.aio.ServerInterceptor):
    """Typed pool errors -> precise status codes; every other unary call passes through unchanged."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior, method = handler.unary_unary, details.method

        async def mapped(request, context):
            if request is _UNREADABLE:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid "
                                    "protobuf message of this method")
            try:
                return await behavior(request, context)
            except PoolError as error:
                code = getattr(grpc.StatusCode, STATUS_NAMES[_error_class(error)])
                trailing = ()
                if isinstance(error, PoolExhausted):
                    trailing = ((RESOURCE_KEY, error.resource), (NEEDED_KEY, str(error.needed)),
                                (AVAILABLE_KEY, str(error.available)))
                await context.abort(code, str(error), trailing_metadata=trailing)
            except Exception:
                logger.exception("%s failed unexpectedly", method)
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"{method} failed unexpectedly; see the server log")

        return grpc.unary_unary_rpc_method_handler(
            mapped, request_deserializer=_readable(handler.request_deserializer),
            response_serializer=handler.response_serializer)


def _error_class(error: PoolError) -> type[PoolError]:
    return next(cls for cls in type(error).__mro__ if cls in STATUS_NAMES)


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <token>` or UNAUTHENTICATED; the health service is exempt."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        handler = await continuation(details)
        if handler is None or hmac.compare_digest(given, self._expected):
            return handler
        message = "missing bearer token" if not given else "wrong bearer token"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{details.method}: {message}")

        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler))
        make = next(make for kind, make in kinds if getattr(handler, kind) is not None)
        return make(deny, request_deserializer=_readable(handler.request_deserializer),
                    response_serializer=handler.response_serializer)


class KVPoolServer:
    """A started `grpc.aio` server for one pool: the KVPool service, health and reflection."""

    def __init__(self, server: grpc.aio.Server, health_servicer, servicer: KVPoolServicer, host: str,
                 port: int):
        self.server, self.health, self.servicer = server, health_servicer, servicer
        self.host, self.port = host, port

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @classmethod
    async def start(cls, blocks: BlockManager, layout: PoolLayout, *, host: str = "127.0.0.1",
                    port: int = 0, token: str | None = None, read_only: bool = False) -> KVPoolServer:
        """read_only: serve GetLayout, PoolStats, health and reflection, and refuse every call that
        changes the pool (the admin port of a serving replica, whose engine owns the BlockManager)."""
        if blocks.epoch != layout.epoch:
            raise ValueError(f"the BlockManager's epoch {blocks.epoch} is not the layout's {layout.epoch}")
        # Room for the largest valid Open: every sequence with a max_model_len prompt (5 bytes a token).
        max_message = min(2**31 - 1, max(4 << 20, blocks.max_num_seqs * blocks.max_model_len * 6 + (1 << 20)))
        interceptors = ([BearerTokenAuth(token)] if token else []) + [_StatusMapper()]
        # so_reuseport off: gRPC turns it on by default, and then a second pool started on a port in use
        # binds as well and the kernel splits the clients between two pools that know nothing of each other.
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message),
            ("grpc.so_reuseport", 0)])
        servicer = KVPoolServicer(blocks, layout, read_only=read_only)
        kvpool_pb2_grpc.add_KVPoolServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = format_address(host, port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(f"cannot listen on {address}: {error}") from None
        if not bound:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("kvpool gRPC listening on %s (auth %s)", format_address(host, bound),
                    "on" if token else "off")
        return cls(server, health_servicer, servicer, host, bound)

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


class BackgroundServer:
    """A KVPoolServer on its own event-loop thread, for synchronous callers (tests, an in-process
    "remote" pool). While it runs, only its thread touches the BlockManager."""

    def __init__(self, blocks: BlockManager, layout: PoolLayout, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, read_only: bool = False):
        self._args = (blocks, layout)
        self._kwargs = {"host": host, "port": port, "token": token, "read_only": read_only}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.server: KVPoolServer | None = None

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, timeout: float = 10.0) -> BackgroundServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpool-grpc", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(KVPoolServer.start(*self._args, **self._kwargs), self._loop)
        try:
            self.server = future.result(timeout)
        except BaseException:
            self._shutdown_loop()
            raise
        return self

    def run_in_server_thread(self, fn, timeout: float = 10.0):
        """`fn()` on the server's thread, the only one that touches the BlockManager while it runs
        (admin work beside the RPCs, such as freeing a dead engine's sequences); returns its result."""
        async def call():
            return fn()

        if self._loop is None:
            raise RuntimeError("the server is not running")
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(grace + 5.0)
            self.server = None
        self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

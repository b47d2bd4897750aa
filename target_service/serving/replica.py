"""Replica: one serving copy of the model: its engine, the OpenAI server over it, the metrics, and the
admin gRPC port (pool stats and health).

With services="inprocess" the engine runs here (an `AsyncEngine` over the in-process assembly) and
the admin port is a read-only server over its pool. With services="ray" the engine runs in three
Ray actors this replica starts (`RayServices`: in the replica's own placement group when it has one,
bundles 1-3), the server drives the target actor through `RemoteEngine`, and the admin port is the
pool actor's own gRPC port (token auth with the admin token). The HTTP contract is the same.

A Ray Serve replica (`target_service.serving.deploy`) only constructs one and delegates; tests build one
directly.
"""

from __future__ import annotations

import logging

from foundation.gc_pauses import freeze_startup_heap, thaw_heap
from foundation.secret_file import API_KEY_ENV, POOL_TOKEN_ENV, load_secret
from kvpool_service.server import BackgroundServer
from target_service.assembly.in_process import build_engine
from target_service.engine.async_engine import AsyncEngine
from target_service.serving.metered_engine import MeteredEngine
from target_service.serving.metrics import ServerMetrics
from target_service.serving.openai_server import STOP_GRACE_S, OpenAIServer
from target_service.serving.serve_args import ServeArgs

logger = logging.getLogger(__name__)


class Replica:
    def __init__(self, args: ServeArgs, rank: int = 0, *, admin_offset: int | None = None):
        """rank: the replica's number in the metrics; admin_offset: added to admin_port (default: rank)."""
        engine_args = args.engine_args()
        self.assembly = self.services = self.admin = None
        self._closed = False
        offset = rank if admin_offset is None else admin_offset
        admin_port = args.admin_port and args.admin_port + offset  # None: off; 0: any free port
        if args.services == "ray":
            tokenizer, max_model_len, groups = self._start_services(args, engine_args, rank, admin_port)
            counters = self.services.counters
            num_speculative_tokens = self.services.plan.num_speculative_tokens
            timed = self.async_engine  # RemoteEngine: the target actor's on_scheduled, passed on
        else:
            self.assembly = build_engine(engine_args)
            engine = timed = self.assembly.engine
            self.async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
            tokenizer, max_model_len = self.assembly.tokenizer, engine.max_model_len
            groups = [group.name for group in self.assembly.pool.layout.spec.groups]
            counters, num_speculative_tokens = engine.counters, engine.num_speculative_tokens
            if admin_port is not None:
                pool = self.assembly.pool
                self.admin = BackgroundServer(pool.blocks, pool.layout, host=args.host, port=admin_port,
                                              token=self._admin_token(args), read_only=True).start()
                logger.info("replica %d: admin gRPC on %s", rank, self.admin.address)
        self.metrics = ServerMetrics(self.async_engine, counters, model_name=args.model_name,
                                     replica=str(rank), groups=groups, max_model_len=max_model_len,
                                     num_speculative_tokens=num_speculative_tokens)
        metered = MeteredEngine(self.async_engine, self.metrics)  # every request's times, for the metrics
        timed.on_scheduled = metered.scheduled  # set before the first request
        api_key = load_secret(args.api_key_file, env=API_KEY_ENV, what="API key")
        self.server = OpenAIServer(metered, tokenizer, model_name=args.model_name,
                                   max_model_len=max_model_len, target_dir=engine_args.target,
                                   api_key=api_key,
                                   spec_decode_metrics=args.per_request_spec_decode_metrics)
        freeze_startup_heap()  # the engine's thread and the server's share the GIL (`foundation.gc_pauses`)

    def _start_services(self, args: ServeArgs, engine_args, rank: int, admin_port: int | None):
        """The pool, drafter and target as Ray actors; the pool's gRPC port is the admin port."""
        from ray.util import get_current_placement_group

        from target_service.assembly.ray_services import RayServices
        from target_service.assembly.remote_engine import RemoteEngine
        from target_service.runner.checkpoint import open_target_checkpoint

        placement = get_current_placement_group()  # a Serve replica's: its own bundle, then the trio's
        self.services = RayServices(engine_args, replica=rank, address=args.address, pool_host=args.host,
                                    pool_port=admin_port or 0, pool_token=self._admin_token(args),
                                    placement=placement,
                                    bundles=(1, 2, 3) if placement else (0, 1, 2)).start()
        self.async_engine = RemoteEngine(self.services, max_num_seqs=args.max_num_seqs,
                                         max_waiting=args.max_waiting)
        pool = self.services.pool_info()
        logger.info("replica %d: services %s, admin gRPC (the pool's) on %s", rank, self.services.pids(),
                    pool.address)
        groups = [group.name for group in pool.handle.layout.spec.groups]
        return open_target_checkpoint(engine_args.target).tokenizer, self.services.max_model_len, groups

    @staticmethod
    def _admin_token(args: ServeArgs) -> str | None:
        return load_secret(args.admin_token_file, env=POOL_TOKEN_ENV)

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let those in flight run for up to `drain_timeout_s`, stop the rest with
        an answer, then release everything. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.server.drain(drain_timeout_s)
        self.async_engine.shutdown(STOP_GRACE_S)
        if self.admin is not None:
            self.admin.stop()
        if self.assembly is not None:
            self.assembly.close()
        thaw_heap()  # what the replica froze at start-up can be collected once it is let go

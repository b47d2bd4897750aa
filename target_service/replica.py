"""Replica: one serving copy of the model, without Ray: the in-process engine, its `AsyncEngine`, the
OpenAI server over them, the metrics, and the admin gRPC port (pool stats and health, read-only).

A Ray Serve replica (`target_service.deploy`) only constructs one and delegates; tests build one
directly. When the Ray services land, this is where the trio is assembled instead of the
in-process engine; the HTTP contract does not change.
"""

from __future__ import annotations

import logging

from kvpool_service.server import BackgroundServer, load_token
from target_service.async_engine import AsyncEngine
from target_service.in_process import build_engine
from target_service.metrics import ServerMetrics
from target_service.openai_server import OpenAIServer
from target_service.serve_args import ServeArgs

logger = logging.getLogger(__name__)


class Replica:
    def __init__(self, args: ServeArgs, rank: int = 0, *, admin_offset: int | None = None):
        """rank: the replica's number in the metrics; admin_offset: added to admin_port (default: rank)."""
        engine_args = args.engine_args()
        self.assembly = build_engine(engine_args)
        engine = self.assembly.engine
        self.async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
        groups = [group.name for group in self.assembly.pool.layout.spec.groups]
        self.metrics = ServerMetrics(self.async_engine, model_name=args.model_name, replica=str(rank),
                                     groups=groups)
        api_key = load_token(args.api_key_file, env="DFLASH_API_KEY")
        self.server = OpenAIServer(self.async_engine, self.assembly.tokenizer, model_name=args.model_name,
                                   max_model_len=engine.scheduler.max_model_len,
                                   target_dir=engine_args.target, metrics=self.metrics, api_key=api_key)
        self.admin = None
        if args.admin_port is not None:
            offset = rank if admin_offset is None else admin_offset
            port = 0 if args.admin_port == 0 else args.admin_port + offset
            pool = self.assembly.pool
            self.admin = BackgroundServer(pool.blocks, pool.layout, host=args.host, port=port,
                                          token=load_token(args.admin_token_file), read_only=True).start()
            logger.info("replica %d: admin gRPC on %s", rank, self.admin.address)

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let the running ones finish, then release everything."""
        self.server.draining = True
        self.async_engine.shutdown(drain_timeout_s)
        if self.admin is not None:
            self.admin.stop()
        self.assembly.close()

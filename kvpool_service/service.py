"""KVPoolService: the pool service in a process of its own (a Ray actor, one per GPU).

It owns the pool's memory (shared: /dev/shm on CPU, CUDA IPC on a GPU) and its block manager, and
serves the block-table verbs and the admin calls (stats, health, reflection, token auth) over gRPC
on its port. Nothing else in the process touches the block manager: every call reaches it through
the gRPC server's thread. What the other services need to find it is one `PoolInfo`.

When the process dies, Ray starts a new one with the same arguments: a fresh, empty pool with a new
epoch, on the same port when one was given. Clients notice the epoch (their mutations fail with
StaleEpoch, or the transport with UNAVAILABLE) and recompute their sequences into the new pool.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kernels.compile_watch import WATCH, CompileCounts
from kvpool_service.assembler import PoolArgs, build_pool
from kvpool_service.control import PoolUsage
from kvpool_service.memory import PoolHandle
from kvpool_service.server import BackgroundServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolInfo:
    """How to reach one incarnation of the pool: map it by `handle`, control it at `address`."""

    handle: PoolHandle
    address: str  # host:port of the gRPC control plane and admin API
    epoch: int
    pid: int


class KVPoolService:
    def __init__(self, args: PoolArgs, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        if not args.share:
            raise ValueError("a pool service shares its memory with other processes: "
                             "PoolArgs.share must be True")
        WATCH.install()  # the pool launches no kernel today; its count says so, and would say otherwise
        self.pool = build_pool(args)
        try:
            self.server = BackgroundServer(self.pool.blocks, self.pool.layout, host=host, port=port,
                                           token=token).start()
        except BaseException:
            self.pool.close()
            raise
        self._info = PoolInfo(self.pool.handle, self.server.address, self.pool.layout.epoch, os.getpid())
        logger.info("pool service: epoch %d at %s (pid %d)", self._info.epoch, self._info.address,
                    self._info.pid)
        WATCH.mark_ready()

    def info(self) -> PoolInfo:
        return self._info

    def compilations(self) -> CompileCounts:
        """Triton kernels this process built, at start-up and since it served."""
        return WATCH.counts()

    def stats(self) -> PoolUsage:
        return self.server.run_in_server_thread(self.pool.blocks.stats)

    def release_all(self) -> int:
        """Close every open sequence (their engine died and will not close them); returns how many."""
        blocks = self.pool.blocks

        def close_all() -> int:
            seq_ids = blocks.open_seq_ids()
            if seq_ids:
                blocks.close(seq_ids)
            return len(seq_ids)

        released = self.server.run_in_server_thread(close_all)
        if released:
            logger.warning("released %d sequences left open by an engine that went away", released)
        return released

    def close(self) -> None:
        self.server.stop()
        self.pool.close()

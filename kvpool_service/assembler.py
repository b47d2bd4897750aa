"""The pool service's assembler: size the pool from its specs and a byte budget, create its memory and
its block manager, and hand out what the other services meet it through.

Others see a `KVPool` only through `handle` (a `PoolHandle`: map the pages) and `control` (a
`PoolControl`: the block-table verbs), in one process or across processes alike. Sizing lives here
and nowhere else: with the draft context paged, one block id costs target + draft bytes; with the
dense baseline, the draft context's worst case (max_num_seqs x max_model_len) is taken off the
budget first and the pool holds the target layers only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from foundation.byte_size import format_bytes
from kvpool_service.block_manager import BlockManager
from kvpool_service.control import PoolControl
from kvpool_service.geometry import PoolLayout, PoolSpec, dense_context_bytes
from kvpool_service.memory import PoolHandle, PoolMemory

logger = logging.getLogger(__name__)

MIN_BLOCKS = 2  # one sequence's growth past its first block needs a second


class PoolArgs(BaseModel):
    """Everything that sizes and configures one pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: PoolSpec  # every group (the draft group whenever there is a drafter)
    budget_bytes: PositiveInt  # for the pool and, with dense context, the dense reservation too
    context_storage: Literal["paged", "dense"] = "paged"
    max_num_seqs: PositiveInt
    max_model_len: PositiveInt
    watermark: float = Field(0.01, ge=0.0, lt=1.0)
    enable_prefix_caching: bool = True
    device: str = "cpu"
    share: bool = True  # False: private memory for the one-process engine


@dataclass(frozen=True)
class PoolSizing:
    """What a budget buys: the pool's own spec, its blocks, and the dense reservation beside it."""

    spec: PoolSpec  # without the draft group when the context is dense
    num_blocks: int
    dense_context_bytes: int


def size_pool(spec: PoolSpec, budget_bytes: int, *, context_storage: str, max_num_seqs: int,
              max_model_len: int) -> PoolSizing:
    """Blocks of `spec` in `budget_bytes`; ValueError naming the sizes when fewer than MIN_BLOCKS fit."""
    dense = context_storage == "dense" and spec.draft is not None
    reserved = (dense_context_bytes(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
                if dense else 0)
    if dense and reserved >= budget_bytes:
        raise ValueError(f"the dense context reservation of {format_bytes(reserved)} (max_num_seqs x "
                         f"max_model_len) leaves nothing of the {format_bytes(budget_bytes)} KV budget")
    pool_spec = spec.without_draft() if dense else spec
    num_blocks = pool_spec.num_blocks(budget_bytes - reserved)
    if num_blocks < MIN_BLOCKS:
        raise ValueError(f"a KV budget of {format_bytes(budget_bytes - reserved)} holds {num_blocks} blocks "
                         f"of {format_bytes(pool_spec.bytes_per_block)}; give more kv_cache_memory")
    return PoolSizing(pool_spec, num_blocks, reserved)


class KVPool:
    """One pool: its memory (owned) and its block manager. Built by `build_pool`."""

    def __init__(self, memory: PoolMemory, blocks: BlockManager, sizing: PoolSizing):
        self.memory = memory
        self.blocks = blocks
        self.sizing = sizing

    @property
    def layout(self) -> PoolLayout:
        return self.memory.layout

    @property
    def handle(self) -> PoolHandle:
        """Map the pages with `PoolMemory.attach(handle, layout)` (any process, or this one)."""
        return self.memory.export()

    @property
    def control(self) -> PoolControl:
        """The block-table verbs, in process; `kvpool_service.server` serves the same over gRPC."""
        return self.blocks

    def close(self) -> None:
        self.memory.close()


def build_pool(args: PoolArgs) -> KVPool:
    sizing = size_pool(args.spec, args.budget_bytes, context_storage=args.context_storage,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    layout = PoolLayout.create(sizing.spec, sizing.num_blocks)
    memory = PoolMemory.create(layout, args.device, share=args.share)
    # A prefix hit restores the draft context from the pool's pages; dense context lives per sequence index
    # outside the pool, so a hit could not restore it: the dense baseline runs without the cache.
    prefix_caching = args.enable_prefix_caching and sizing.dense_context_bytes == 0
    blocks = BlockManager.from_layout(layout, max_num_seqs=args.max_num_seqs,
                                      max_model_len=args.max_model_len, watermark=args.watermark,
                                      enable_prefix_caching=prefix_caching)
    logger.info("KV pool: %d blocks of %d tokens (%s per token), context %s", sizing.num_blocks,
                sizing.spec.tokens_per_block, format_bytes(sizing.spec.bytes_per_token), args.context_storage)
    return KVPool(memory, blocks, sizing)

"""The drafter service's assembler: a `DraftWorker` from its checkpoint, the target checkpoint, a
`PoolHandle` and the step buffers' handle, and nothing else.

The drafter loads what it needs of the target (the embedding and lm_head tables) from the target
checkpoint itself, maps the pool's draft spec layers from the handle (or, for the dense baseline,
allocates its own per-sequence context), and maps the step buffers the target fills. It runs the same in
the target's process or in its own.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from drafter_service.checkpoint import load_drafter, open_drafter_checkpoint
from drafter_service.context_graphs import ContextGraphs, context_row_sizes
from drafter_service.context_storage import DenseContext, PagedContext
from drafter_service.cuda_graphs import ProposeGraphs
from drafter_service.draft_worker import DraftWorker
from drafter_service.step_buffers import StepBuffers, StepBuffersHandle
from drafter_service.target_tables import load_target_tables
from foundation.checkpoint_config import load_target_config
from foundation.cuda_graph_sizes import capture_sizes
from foundation.weights import resolve_dtype
from kvpool_service.geometry import PoolSpec
from kvpool_service.memory import PoolHandle, PoolMemory

logger = logging.getLogger(__name__)


class DrafterArgs(BaseModel):
    """The drafter's settings; names are the engine's (`EngineArgs`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    drafter: str
    target: str  # the target checkpoint: its config and its token tables
    dtype: str | None = None  # None: each checkpoint's own dtype
    device: str = "cpu"
    context_storage: Literal["paged", "dense"] = "paged"
    max_num_seqs: PositiveInt
    max_model_len: PositiveInt
    enforce_eager: bool = False  # no CUDA graphs of the block forward (they are captured only on a GPU)
    cuda_graph_sizes: list[int] | None = None


class DrafterAssembler:
    """`load()` reads the weights (before the pool is sized, so a GPU budget counts them);
    `build(pool_handle, step_handle)` maps the shared memory and returns the worker."""

    def __init__(self, args: DrafterArgs):
        self.args = args
        self.target_config = load_target_config(args.target)
        self.config, _ = open_drafter_checkpoint(args.drafter, self.target_config)
        self.model = None
        self.tables = None
        self.memory: PoolMemory | None = None
        self.buffers: StepBuffers | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def load(self) -> DrafterAssembler:
        args, device = self.args, torch.device(self.args.device)
        self.model = load_drafter(args.drafter, self.target_config, dtype=args.dtype, device=device)
        table_dtype = resolve_dtype(args.dtype, self.target_config.dtype_name)
        self.tables = load_target_tables(args.target, self.target_config, dtype=table_dtype, device=device)
        return self

    def build(self, pool_handle: PoolHandle, step_handle: StepBuffersHandle) -> DraftWorker:
        """A worker over the pool and step buffers behind the handles; building again (after the target
        or the pool restarted) drops the previous mappings first."""
        if self.model is None:
            self.load()
        self.close()
        context = self._context(pool_handle)
        self.buffers = StepBuffers.attach(step_handle, step_handle.layout.model_copy(update={
            "tap_width": len(self.config.target_layer_ids) * self.target_config.hidden_size,
            "max_num_draft": self.config.block_size - 1,
        }))
        worker = DraftWorker(self.model, context, self.buffers, embed=self.tables.embed_tokens,
                             lm_head=self.tables.lm_head)
        if torch.device(self.args.device).type == "cuda" and not self.args.enforce_eager:
            sizes = capture_sizes(min(self.args.max_num_seqs, self.buffers.layout.max_num_seqs),
                                  self.args.cuda_graph_sizes)
            worker.graphs = ProposeGraphs(worker, sizes).capture()
            rows = context_row_sizes(sizes, self.config.block_size, self.buffers.layout.max_context_rows)
            worker.context_graphs = ContextGraphs(worker, rows).capture()
        return worker

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None

    def _context(self, pool_handle: PoolHandle):
        """The draft spec layers of the pool (paged), or a dense per-sequence reservation (baseline)."""
        args, layout = self.args, pool_handle.layout
        tokens_per_block = layout.spec.tokens_per_block
        own = PoolSpec.from_configs(self.target_config, self.config, tokens_per_block=tokens_per_block,
                                    dtype=str(self.tables.embed_tokens.dtype).removeprefix("torch.")).draft
        if args.context_storage == "dense":
            return DenseContext(own, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                tokens_per_block=tokens_per_block, device=args.device)
        # Refuse a pool whose draft group is not this drafter's (the differing fields are named).
        expected = layout.model_copy(update={"spec": layout.spec.model_copy(update={"draft": own})})
        self.memory = PoolMemory.attach(pool_handle, expected)
        return PagedContext(self.memory.layers("draft"))

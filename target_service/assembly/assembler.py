"""The target service's assembler: the target model, its step buffers and the engine, built against
the pool's `PoolControl` + `PoolHandle` and the drafter's `DraftControl` only.

It decides what only the target can know: the compute device and dtype, the taps the drafter
needs (from the drafter's config), K, and the KV budget (on a GPU: what is left after the weights
and a profiling forward). The pool service sizes the pool from that budget; the drafter service
maps the step buffers this assembler creates.
"""

from __future__ import annotations

import logging

from drafter_service.control import DraftControl
from drafter_service.step_buffers import StepBufferLayout, StepBuffers
from foundation.byte_size import parse_byte_size
from foundation.checkpoint_config import check_drafter_fits, load_drafter_config
from foundation.cuda_graph_sizes import capture_sizes
from foundation.weights import resolve_dtype
from kvpool_service.control import PoolControl
from kvpool_service.geometry import DTYPE_NAMES, PoolSpec
from kvpool_service.memory import PoolHandle, PoolMemory
from target_service.assembly.engine_args import (
    EngineArgs,
    compute_dtype,
    num_speculative_tokens,
    resolve_device,
)
from target_service.engine.engine import LLMEngine
from target_service.engine.scheduler import Scheduler
from target_service.engine.stop_checker import StopChecker
from target_service.runner.checkpoint import load_target, open_target_checkpoint
from target_service.runner.cuda_graphs import GraphKey, TargetGraphs
from target_service.runner.memory_budget import device_kv_budget

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_MEMORY = 256 * 2**20


class TargetAssembler:
    """`load()` the weights, then `kv_budget()`, `create_step_buffers()` and `build(...)`."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = compute_dtype(args.dtype, self.device)
        self.checkpoint = open_target_checkpoint(args.target)
        config = self.checkpoint.config
        self.drafter_config = load_drafter_config(args.drafter) if args.drafter is not None else None
        if self.drafter_config is not None:
            check_drafter_fits(config, self.drafter_config)
        block_size = self.drafter_config.block_size if self.drafter_config is not None else None
        self.num_speculative_tokens = num_speculative_tokens(args.num_speculative_tokens, block_size)
        if args.max_model_len is not None and args.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the target's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        self.model = None
        self.memory: PoolMemory | None = None
        self.buffers: StepBuffers | None = None

    @property
    def tap_layer_ids(self) -> list[int]:
        return list(self.drafter_config.target_layer_ids) if self.drafter_config is not None else []

    def load(self) -> TargetAssembler:
        self.model, _ = load_target(self.checkpoint, tap_layer_ids=self.tap_layer_ids, dtype=self.dtype,
                                    device=self.device)
        return self

    @property
    def kv_dtype(self) -> str:
        """The compute dtype: the draft context's and the taps' dtype, and the target's pages' unless
        kv_cache_dtype is "fp8" (`target_cache_dtype`); known before loading."""
        return str(resolve_dtype(self.dtype, self.checkpoint.config.dtype_name)).removeprefix("torch.")

    @property
    def target_cache_dtype(self) -> str:
        """The target group's page dtype: kv_dtype, or float8 e4m3 with kv_cache_dtype="fp8"."""
        return DTYPE_NAMES["fp8"] if self.args.kv_cache_dtype == "fp8" else self.kv_dtype

    def pool_spec(self) -> PoolSpec:
        """Every group the pool needs for this pair (the pool drops the draft group for dense context).

        Read from the configs alone, so a pool process can size the pool without loading weights."""
        return PoolSpec.from_configs(self.checkpoint.config, self.drafter_config,
                                     tokens_per_block=self.args.tokens_per_block,
                                     dtype=self.target_cache_dtype, context_dtype=self.kv_dtype)

    def kv_budget(self) -> int:
        """kv_cache_memory when given; on a GPU what the weights and activations leave; else a default."""
        args = self.args
        if args.kv_cache_memory is not None:
            return parse_byte_size(args.kv_cache_memory)
        if self.device.type == "cuda":
            return device_kv_budget(self._model(), self.device, args.gpu_memory_utilization,
                                    args.max_num_batched_tokens)
        return CPU_DEFAULT_KV_MEMORY

    def create_step_buffers(self, *, share: bool) -> StepBuffers | None:
        """The buffers the drafter maps (None without a drafter); share=True to hand them out of process."""
        if self.drafter_config is None:
            return None
        config = self.checkpoint.config
        layout = StepBufferLayout(
            max_num_seqs=self.args.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.args.tokens_per_block),
            max_num_draft=self.drafter_config.block_size - 1,
            max_context_rows=self.args.max_num_batched_tokens,
            tap_width=len(self.tap_layer_ids) * config.hidden_size, tap_dtype=self.kv_dtype,
        )
        self.buffers = StepBuffers.create(layout, self.device, share=share)
        return self.buffers

    def build(self, pool: PoolControl, pool_handle: PoolHandle, drafter: DraftControl | None) -> LLMEngine:
        """The engine over the pool's target layers (mapped from the handle) and the drafter's calls."""
        if (drafter is None) != (self.drafter_config is None):
            raise ValueError("a drafter was configured but none was given, or the reverse")
        if drafter is not None and self.buffers is None:
            raise RuntimeError("create_step_buffers() comes before build() when there is a drafter")
        if drafter is not None and drafter.block_size != self.drafter_config.block_size:
            raise ValueError(f"the drafter's block_size {drafter.block_size} differs from its config's "
                             f"{self.drafter_config.block_size}")
        model, args = self._model(), self.args
        caches, layout = self._attach(pool_handle)
        limits = pool.limits()
        scheduler = Scheduler(pool, max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              num_speculative_tokens=self.num_speculative_tokens)
        stop_checker = StopChecker(self.checkpoint.eos_token_ids, self.checkpoint.tokenizer)
        return LLMEngine(model, caches, scheduler, limits=limits, drafter=drafter, step_buffers=self.buffers,
                         stop_checker=stop_checker, seed=args.seed, graphs=self._graphs(caches, layout),
                         async_scheduling=args.async_scheduling)

    def rebind(self, engine: LLMEngine, pool: PoolControl, pool_handle: PoolHandle) -> list:
        """Move `engine` onto a restarted pool: map its pages, capture graphs over them, and requeue
        every running sequence for recompute (the new pool is empty). Returns the requeued ones."""
        previous = self.memory
        caches, layout = self._attach(pool_handle)
        engine.graphs = None  # the old graphs hold the old pages; free them before capturing new ones
        requeued = engine.rebind_pool(pool, caches, pool.limits(), self._graphs(caches, layout))
        if previous is not None:
            previous.close()
        return requeued

    def _attach(self, pool_handle: PoolHandle):
        """The pool's target layers, mapped from the handle (refused unless the layout is ours)."""
        layout = pool_handle.layout
        own = PoolSpec.from_configs(self.checkpoint.config, tokens_per_block=layout.spec.tokens_per_block,
                                    dtype=self.target_cache_dtype).target
        expected = layout.model_copy(update={"spec": layout.spec.model_copy(update={"target": own})})
        self.memory = PoolMemory.attach(pool_handle, expected)
        return self.memory.layers("target"), layout

    def _graphs(self, caches, layout) -> TargetGraphs | None:
        """CUDA graphs of the steady-state steps (verify K + 1 rows with taps, or a 1-row decode)."""
        if self.device.type != "cuda" or self.args.enforce_eager:
            return None
        keys = ([GraphKey(self.num_speculative_tokens + 1, True), GraphKey(1, True)]
                if self.drafter_config is not None else [GraphKey(1, False)])
        sizes = capture_sizes(self.args.max_num_seqs, self.args.cuda_graph_sizes)
        max_blocks = -(-self.max_model_len // layout.spec.tokens_per_block)
        return TargetGraphs(self._model(), caches, sizes=sizes, keys=keys, max_blocks_per_seq=max_blocks,
                            device=self.device).capture()

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        if self.buffers is not None:
            self.buffers.close()

    def _model(self):
        if self.model is None:
            raise RuntimeError("load() the target first")
        return self.model

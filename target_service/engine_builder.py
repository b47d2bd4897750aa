"""Build an in-process engine from checkpoints: models, the pool (memory + block manager), context.

This is the one place that decides sizes: the pool budget (`kv_cache_memory`, or a fraction of the
device after weights and a profiling forward, or a fixed default on CPU), the pool's groups (the
draft group only when the context is paged), and the dense reservation of the baseline.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from drafter_service.checkpoint import load_drafter
from drafter_service.context_storage import DenseContext, PagedContext
from drafter_service.drafter import DraftWorker
from foundation.byte_size import format_bytes, parse_byte_size
from kvpool_service.blocks import BlockManager
from kvpool_service.memory import PoolMemory
from kvpool_service.spec import PoolLayout, PoolSpec
from target_service.checkpoint import load_target, open_target_checkpoint
from target_service.engine import LLMEngine
from target_service.memory_budget import device_kv_budget
from target_service.scheduler import Scheduler
from target_service.stop_checker import StopChecker

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_MEMORY = 256 * 2**20


class EngineArgs(BaseModel):
    """Every engine setting, validated once; field names are the CLI's and `LLM`'s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str
    drafter: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1)
    context_storage: Literal["paged", "dense"] = "paged"
    dtype: Literal["bfloat16", "float16", "float32", "bf16", "fp16", "fp32"] | None = None
    device: str | None = None
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    tokens_per_block: int = 32
    enable_prefix_caching: bool = True
    seed: int | None = None

    @model_validator(mode="after")
    def _sizes(self):
        if self.kv_cache_memory is not None:
            parse_byte_size(self.kv_cache_memory)
        return self


def resolve_device(name: str | None) -> torch.device:
    """`name` as a device (None: cuda when available); asking for CUDA without it is an error."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def compute_dtype(asked: str | None, device: torch.device) -> str | None:
    """The dtype asked for; with none, float32 on CPU and the checkpoint's own dtype (None) elsewhere.

    CPUs have no fast 16-bit matrix units to gain from, and 16-bit weights are exact in float32,
    so a CPU engine computes in float32 by default: greedy decoding with a drafter is then lossless
    bit for bit (bf16 verify blocks and 1-token decodes round near-ties differently).
    """
    if asked is not None:
        return asked
    return "float32" if device.type == "cpu" else None


def build_engine(args: EngineArgs) -> tuple[LLMEngine, object, PoolMemory]:
    """(engine, tokenizer or None, pool memory); the caller owns the memory and closes it."""
    device = resolve_device(args.device)
    dtype = compute_dtype(args.dtype, device)
    checkpoint = open_target_checkpoint(args.target)
    config = checkpoint.config
    draft_model = None
    if args.drafter is not None:
        draft_model = load_drafter(args.drafter, config, dtype=dtype, device=device)
    taps = draft_model.target_layer_ids if draft_model is not None else ()
    target, _ = load_target(checkpoint, tap_layer_ids=taps, dtype=dtype, device=device)
    num_draft = _num_speculative_tokens(args, draft_model)
    max_model_len = args.max_model_len or config.max_position_embeddings
    kv_dtype = str(target.embed_weight.dtype).removeprefix("torch.")
    spec = PoolSpec.from_configs(config, draft_model.config if draft_model else None,
                                 tokens_per_block=args.tokens_per_block, dtype=kv_dtype)
    budget = _kv_budget(args, target, device)
    dense = args.context_storage == "dense" and draft_model is not None
    if dense:
        reservation = args.max_num_seqs * -(-max_model_len // spec.tokens_per_block) * spec.tokens_per_block \
            * spec.draft.bytes_per_token
        if reservation >= budget:
            raise ValueError(f"the dense context reservation of {format_bytes(reservation)} (max_num_seqs x "
                             f"max_model_len) leaves nothing of the {format_bytes(budget)} KV budget")
        budget -= reservation
    pool_spec = spec.without_draft() if dense or draft_model is None else spec
    num_blocks = pool_spec.num_blocks(budget)
    if num_blocks < 2:
        raise ValueError(f"a KV budget of {format_bytes(budget)} holds {num_blocks} blocks of "
                         f"{format_bytes(pool_spec.bytes_per_block)}; give more kv_cache_memory")
    layout = PoolLayout.create(pool_spec, num_blocks)
    memory = PoolMemory.create(layout, device, share=False)  # one process: no /dev/shm file needed
    logger.info("KV pool: %d blocks of %d tokens (%s per token), context %s", num_blocks,
                spec.tokens_per_block, format_bytes(pool_spec.bytes_per_token), args.context_storage)
    pool = BlockManager.from_layout(layout, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                                    enable_prefix_caching=args.enable_prefix_caching and not dense)
    worker = None
    if draft_model is not None:
        context = (DenseContext(spec.draft, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                                tokens_per_block=spec.tokens_per_block, device=device)
                   if dense else PagedContext(memory.layers("draft")))
        worker = DraftWorker(draft_model, context, embed=target.embed_weight, lm_head=target.lm_head_weight)
    scheduler = Scheduler(pool, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          num_speculative_tokens=num_draft)
    stop_checker = StopChecker(checkpoint.eos_token_ids, checkpoint.tokenizer)
    engine = LLMEngine(target, memory.layers("target"), scheduler,
                       tokens_per_block=spec.tokens_per_block, num_blocks=num_blocks, drafter=worker,
                       stop_checker=stop_checker, seed=args.seed)
    return engine, checkpoint.tokenizer, memory


def _num_speculative_tokens(args: EngineArgs, draft_model) -> int:
    if draft_model is None:
        if args.num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs a drafter")
        return 0
    limit = draft_model.block_size - 1
    value = args.num_speculative_tokens or limit
    if value > limit:
        raise ValueError(f"num_speculative_tokens {value} exceeds the drafter's block_size - 1 = {limit}")
    return value


def _kv_budget(args: EngineArgs, target, device: torch.device) -> int:
    if args.kv_cache_memory is not None:
        return parse_byte_size(args.kv_cache_memory)
    if device.type == "cuda":
        return device_kv_budget(target, device, args.gpu_memory_utilization, args.max_num_batched_tokens)
    return CPU_DEFAULT_KV_MEMORY

"""A DraftWorker assembled the way the engine assembles it (pool, step buffers, drafter) over a tiny
random pair, for tests that drive the drafter directly through its step buffers."""

from __future__ import annotations

import torch
from tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

from drafter_service.assembler import DrafterAssembler
from kvpool_service.assembler import build_pool
from target_service.assembly.assembler import TargetAssembler
from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import resolve_plan

TOKENS_PER_BLOCK = 16


def make_draft_worker(tmp_path, *, block_size: int = 8, max_num_seqs: int = 4, max_model_len: int = 64):
    """(worker, step buffers, pool) on CPU; the caller closes the pool."""
    seed = int(torch.randint(0, 2**31, ()))
    target = write_target_checkpoint(tmp_path / "t", seed=seed)
    drafter = write_drafter_checkpoint(tmp_path / "d", target, block_size=block_size, seed=seed + 1)
    args = EngineArgs(target=str(target), drafter=str(drafter), device="cpu",
                      tokens_per_block=TOKENS_PER_BLOCK, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, kv_cache_memory="1MiB")
    plan = resolve_plan(args)
    sizer = TargetAssembler(plan)
    pool = build_pool(plan.pool_args(sizer.kv_budget(), share=False))
    buffers = sizer.create_step_buffers(share=False)
    assembler = DrafterAssembler(plan.drafter_args())
    return assembler.load().build(pool.handle, buffers.export()), buffers, pool

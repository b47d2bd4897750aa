"""DraftWorker through the step buffers: a K below block_size - 1 drafts the trained block, verifies less."""

import torch
from tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

from drafter_service.assembler import DrafterArgs, DrafterAssembler
from kvpool_service.assembler import PoolArgs, build_pool
from target_service.assembler import TargetAssembler
from target_service.engine_args import EngineArgs

TPB = 16


def make_worker(tmp_path, block_size=8):
    seed = int(torch.randint(0, 2**31, ()))
    target = write_target_checkpoint(tmp_path / "t", seed=seed)
    drafter = write_drafter_checkpoint(tmp_path / "d", target, block_size=block_size, seed=seed + 1)
    args = EngineArgs(target=str(target), drafter=str(drafter), device="cpu", tokens_per_block=TPB,
                      max_num_seqs=4, max_model_len=64, kv_cache_memory="1MiB")
    sizer = TargetAssembler(args)
    pool = build_pool(PoolArgs(spec=sizer.pool_spec(), budget_bytes=sizer.kv_budget(), max_num_seqs=4,
                               max_model_len=64, share=False))
    buffers = sizer.create_step_buffers(share=False)
    worker = DrafterAssembler(DrafterArgs(drafter=str(drafter), target=str(target), dtype=sizer.dtype,
                                          max_num_seqs=4, max_model_len=64)).load()
    return worker.build(pool.handle, buffers.export()), buffers, pool


def test_a_smaller_k_gets_the_first_k_drafts_of_the_full_block(tmp_path):
    worker, buffers, pool = make_worker(tmp_path)
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]  # 4 sequences with their own pages
    lengths = [5, 17, 20, 31]  # stored context per sequence, across a page edge
    rows = [(seq, pos) for seq, n in enumerate(lengths) for pos in range(n)]
    taps = torch.randn(len(rows), buffers.layout.tap_width)
    slots = [tables[seq][pos // TPB] * TPB + pos % TPB for seq, pos in rows]
    num_rows = buffers.stage_context(taps, [pos for _, pos in rows], [seq for seq, _ in rows], slots)
    worker.store_context(num_rows)
    bonus = torch.randint(3, 150, (4,)).tolist()
    columns = buffers.stage_propose(bonus, lengths, [0, 1, 2, 3], tables)
    worker.propose(4, 7, columns)  # K = block_size - 1
    full = buffers.draft_tokens[:4, :7].clone()
    for k in (1, 3, 5):
        buffers.draft_tokens.zero_()
        worker.propose(4, k, columns)
        assert torch.equal(buffers.draft_tokens[:4, :k], full[:, :k]), k
    pool.close()

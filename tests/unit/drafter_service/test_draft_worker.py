"""DraftWorker through the step buffers: a K below block_size - 1 drafts the trained block, verifies less."""

import torch
from draft_workers import TOKENS_PER_BLOCK as TPB
from draft_workers import make_draft_worker


def test_a_smaller_k_gets_the_first_k_drafts_of_the_full_block(tmp_path):
    worker, buffers, pool = make_draft_worker(tmp_path)
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

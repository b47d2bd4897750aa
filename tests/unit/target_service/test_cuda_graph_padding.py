"""What the CUDA graph runners do around the replay, checked eagerly on CPU (capture=False): a batch
padded to a captured size gives the unpadded forward's logits, taps and drafts, and the dummy
sequences write nothing. The replay itself is the GPU tests' (tests/engine/test_engine_gpu.py)."""

import random

import pytest
import torch
from tiny_checkpoints import write_target_checkpoint

from drafter_service.context_graphs import DEFERRED_STORE_ROWS, ContextGraphs, context_row_sizes
from drafter_service.cuda_graphs import ProposeGraphs
from target_service.proposers.deferred_context import MAX_DEFERRED_ROWS
from target_service.runner.checkpoint import load_target
from target_service.runner.cuda_graphs import GraphKey, TargetGraphs
from target_service.runner.forward_batch import SeqChunk, pack

TPB = 16


def arena_and_caches(config, num_blocks=32):
    shape = (num_blocks, config.num_hidden_layers, 2, TPB, config.num_key_value_heads, config.head_dim)
    arena = torch.randn(shape)  # pages hold old K/V: the dummies must not overwrite any of it
    return arena, [(arena[:, i, 0], arena[:, i, 1]) for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize(("q_len", "taps", "num_seqs"), [(4, True, 3), (1, False, 5), (4, True, 4)])
def test_a_padded_target_batch_equals_the_unpadded_forward(tmp_path, q_len, taps, num_seqs):
    directory = write_target_checkpoint(tmp_path / "t", seed=int(torch.randint(0, 2**31, ())))
    model, _ = load_target(directory, tap_layer_ids=(1, 2) if taps else (), dtype="float32", progress=False)
    blocks = list(range(32))
    random.Random(0).shuffle(blocks)
    chunks = []
    for index in range(num_seqs):
        start = random.Random(index).randrange(5, 60)  # tokens already in the cache
        table = blocks[index * 5:(index + 1) * 5]
        tokens = torch.randint(3, 150, (q_len,)).tolist()
        chunks.append(SeqChunk(tokens, start, table, num_logits=q_len, num_taps=q_len if taps else 0))
    batch = pack(chunks, TPB)
    arena, caches = arena_and_caches(model.config)
    expected_arena = arena.clone()
    expected = model(batch, [(expected_arena[:, i, 0], expected_arena[:, i, 1])
                             for i in range(model.config.num_hidden_layers)])
    graphs = TargetGraphs(model, caches, sizes=[1, 2, 4, 8], keys=[GraphKey(q_len, taps)],
                          max_blocks_per_seq=8, device=torch.device("cpu"), capture=False)
    got = graphs.run(batch, GraphKey(q_len, taps))
    assert graphs.padded_size(num_seqs) == (4 if num_seqs <= 4 else 8)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.taps, expected.taps, rtol=1e-5, atol=1e-5)
    assert torch.equal(arena, expected_arena)  # the real rows wrote the same K/V; the dummies none
    assert graphs.run(batch, GraphKey(q_len + 1, taps)) is None  # no graph of that shape: eager


def test_a_padded_proposal_equals_the_unpadded_one(tmp_path):
    from draft_workers import make_draft_worker

    worker, buffers, pool = make_draft_worker(tmp_path, max_num_seqs=8)
    rows = [(seq, pos) for seq, n in enumerate([9, 20, 33]) for pos in range(n)]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    slots = [tables[seq][pos // TPB] * TPB + pos % TPB for seq, pos in rows]
    worker.store_context(buffers.stage_context(torch.randn(len(rows), buffers.layout.tap_width),
                                               [p for _, p in rows], [s for s, _ in rows], slots))
    columns = buffers.stage_propose([5, 6, 7], [9, 20, 33], [0, 1, 2], tables)
    buffers.start_positions[3:].fill_(40)  # stale rows from an earlier, larger step
    worker.draft_rows(3, columns)
    expected = buffers.draft_tokens[:3].clone()
    buffers.draft_tokens.zero_()
    assert ProposeGraphs(worker, [1, 2, 4, 8], capture=False).run(3)
    assert torch.equal(buffers.draft_tokens[:3], expected)
    assert buffers.start_positions[3:4].tolist() == [0]  # the dummy row's context was emptied
    assert not ProposeGraphs(worker, [1, 2], capture=False).run(3)
    pool.close()


def test_a_padded_context_store_writes_exactly_what_the_unpadded_one_writes(tmp_path):
    from draft_workers import make_draft_worker

    worker, buffers, pool = make_draft_worker(tmp_path, max_num_seqs=8)
    pages = [page for cache in worker.context.caches for page in cache[:2]]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    rows = [(seq, pos) for seq, n in enumerate([9, 14, 5]) for pos in range(n)]
    slots = [tables[seq][pos // TPB] * TPB + pos % TPB for seq, pos in rows]
    slots = [slot if random.random() < 0.7 else -1 for slot in slots]  # rejected drafts: not stored
    num_rows = buffers.stage_context(torch.randn(len(rows), buffers.layout.tap_width),
                                     [p for _, p in rows], [s for s, _ in rows], slots)
    padded = 32
    # rows past num_rows hold an earlier, larger step's rows: real slots a wrong padding would write
    buffers.taps[num_rows:padded].normal_()
    buffers.context_slots[num_rows:padded].copy_(torch.arange(padded - num_rows) + 9 * TPB)
    buffers.context_positions[num_rows:padded].fill_(17)
    before = [page.clone() for page in pages]
    worker.store_rows(num_rows)
    expected = [page.clone() for page in pages]
    assert any(not torch.equal(a, b) for a, b in zip(before, expected))  # the real rows stored something
    for page, old in zip(pages, before):
        page.copy_(old)
    assert ContextGraphs(worker, [8, 16, padded, 64], capture=False).run(num_rows)
    assert all(torch.equal(page, want) for page, want in zip(pages, expected))
    assert buffers.context_slots[num_rows:padded].tolist() == [-1] * (padded - num_rows)
    assert not ContextGraphs(worker, [8, 16], capture=False).run(num_rows)  # none large enough: eager
    refused = ContextGraphs(worker, [8, 16, padded], capture=True).capture()  # CPU buffers: refused
    assert refused.sizes == [] and not refused.run(num_rows)  # so the store runs eagerly
    pool.close()


def test_context_graph_sizes_are_the_batch_sizes_times_the_block_and_a_deferred_store_up_to_the_cap():
    assert DEFERRED_STORE_ROWS == MAX_DEFERRED_ROWS  # a hybrid's deferred store replays one graph
    assert context_row_sizes([1, 2, 3, 8, 12, 64, 128], 16, 10_000) == [16, 32, 48, 128, 192, 256, 1024]
    assert context_row_sizes([1, 2, 4], 16, 10_000) == [16, 32, 64, 256]
    assert context_row_sizes([1, 2, 4], 8, 20) == [8, 16]  # the step buffers' rows cap them too

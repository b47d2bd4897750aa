"""DFlash training blocks against hand-built examples: anchors, the block mask, labels, loss weights."""

import math

import pytest
import torch

from training.anchors import (
    build_blocks,
    default_gamma,
    loss_decay,
    sample_anchors,
    weighted_block_loss,
)

MASK = 99


def hand_mask(anchors, keep, seq_len, block_size):
    """[b, n, B, S + B] built cell by cell: context strictly before the anchor, own block only."""
    batch, blocks = len(anchors), len(anchors[0])
    mask = torch.zeros(batch, blocks, block_size, seq_len + block_size, dtype=torch.bool)
    for b in range(batch):
        for j in range(blocks):
            for q in range(block_size):
                for kv in range(seq_len):
                    mask[b, j, q, kv] = keep[b][j] and kv < anchors[b][j]
                for kv in range(block_size):
                    mask[b, j, q, seq_len + kv] = True  # bidirectional in the block, even for padding
    return mask


def test_blocks_match_a_hand_built_example_with_a_short_padded_row():
    # row 0: 8 real tokens, anchors 1 and 4; row 1: 3 real tokens then padding, one real anchor
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([8, 3])
    loss_mask = torch.ones(2, 8, dtype=torch.bool)
    loss_mask[0, 6] = False  # a position excluded from the loss (a prompt token, say)
    anchors = torch.tensor([[1, 4], [0, 0]])
    keep = torch.tensor([[True, True], [True, False]])
    blocks = build_blocks(ids, lengths, loss_mask, anchors, keep, block_size=3, mask_token_id=MASK, gamma=2.0)

    assert torch.equal(blocks.mask, hand_mask(anchors.tolist(), keep.tolist(), 8, 3))
    assert blocks.noise_ids.tolist() == [[[11, MASK, MASK], [14, MASK, MASK]],
                                         [[20, MASK, MASK], [MASK, MASK, MASK]]]
    assert blocks.positions.tolist() == [[[1, 2, 3], [4, 5, 6]], [[0, 1, 2], [0, 1, 2]]]
    assert blocks.labels[0].tolist() == [[11, 12, 13], [14, 15, 16]]
    e = math.exp(-0.5)
    expected = [[[0, 1, e], [0, 1, 0]],   # block position 2 of block 2 is position 6: outside the loss mask
                [[0, 1, e], [0, 0, 0]]]   # the padding block has no loss at all
    assert torch.allclose(blocks.weights, torch.tensor(expected))


def test_block_at_the_end_of_a_short_row_has_no_loss_past_its_length():
    ids = torch.tensor([[5, 6, 7, 8, 0, 0]])
    blocks = build_blocks(ids, torch.tensor([4]), torch.ones(1, 6, dtype=torch.bool), torch.tensor([[2]]),
                          torch.tensor([[True]]), block_size=4, mask_token_id=MASK, gamma=7.0)
    assert blocks.weights[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]  # positions 4, 5 are padding
    assert blocks.mask[0, 0, :, :6].tolist() == [[True, True, False, False, False, False]] * 4


def test_loss_decay_is_hand_computed():
    assert torch.allclose(loss_decay(4, 2.0), torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    weights = loss_decay(16, 7.0)
    assert weights[0] == 0 and torch.allclose(weights[15], torch.tensor(math.exp(-2.0)))
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    with pytest.raises(ValueError, match="gamma"):
        loss_decay(4, 0.0)


def test_weighted_loss_equals_a_float64_sum():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    logits = torch.randn(2, 3, 4, 11, generator=gen)  # [b, n, B-1, V]
    labels = torch.randint(0, 11, (2, 3, 5), generator=gen)
    weights = torch.rand(2, 3, 5, generator=gen) * (torch.rand(2, 3, 5, generator=gen) > 0.3)
    loss, accuracy = weighted_block_loss(logits, labels, weights)
    total = hits = counted = 0.0
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(1, 5)).tolist():
        b, j, k = idx
        row = logits[b, j, k - 1].double()
        ce = torch.logsumexp(row, 0) - row[labels[b, j, k]]
        total += float(weights[b, j, k]) * float(ce)
        if weights[b, j, k] > 0:
            counted += 1
            hits += int(row.argmax() == labels[b, j, k])
    assert loss.item() == pytest.approx(total / float(weights[..., 1:].sum()), rel=1e-5)
    assert accuracy.item() == pytest.approx(hits / counted)


def test_anchors_are_valid_distinct_sorted_and_padded():
    lengths = torch.tensor([20, 6, 1])
    loss_mask = torch.zeros(3, 20, dtype=torch.bool)
    loss_mask[0, 10:] = True      # a prompt of 10 tokens, then the continuation
    loss_mask[1, :] = True
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    seen = set()
    for _ in range(200):
        anchors, keep = sample_anchors(lengths, loss_mask, 4, gen)
        real = [anchors[b][keep[b]].tolist() for b in range(3)]
        assert keep.sum(1).tolist() == [4, 4, 0]   # row 1 has 5 valid anchors (0..4), row 2 none
        for b, row in enumerate(real):
            assert row == sorted(set(row))
            assert all(a + 1 < lengths[b] and loss_mask[b, a + 1] for a in row)
        seen.update(real[0])
        assert (anchors[~keep] == 0).all()
    assert seen == set(range(9, 19))  # every valid anchor of row 0 gets drawn: a uniform sample


def test_bad_anchor_requests_are_refused():
    with pytest.raises(ValueError, match="lengths"):
        sample_anchors(torch.tensor([3]), torch.ones(2, 5, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.tensor([3, 3]), torch.ones(2, 5, dtype=torch.bool), 0)

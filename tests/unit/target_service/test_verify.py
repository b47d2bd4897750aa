"""Verification on the device (`target_service.runner.verify`) against the accept rule stated over plain
ints (`sampling.accept_drafts`) and a host-built packing, over fresh random steps."""

import random

import pytest
import torch

from target_service.runner.sampling import accept_drafts
from target_service.runner.verify import DraftIndex

VOCAB = 5  # a tiny vocabulary, so drafts match the target often and every accepted length occurs


def random_step(rng: random.Random):
    """A step's decodes: per decode its drafts (0..K of them), its target tokens (one more), and
    where it sits among the decodes that draft. Returns the decodes and the step buffers' drafts."""
    width, decodes, source_rows = rng.randint(1, 8), [], 0
    for _ in range(rng.randint(1, 9)):
        num_draft = rng.choice([0, rng.randint(1, width), width])
        drafts = [rng.randrange(VOCAB) for _ in range(num_draft)]
        # targets agree with the drafts up to a random point, then anything
        agree = rng.randint(0, num_draft)
        targets = drafts[:agree] + [rng.randrange(VOCAB) for _ in range(num_draft + 1 - agree)]
        decodes.append((drafts, targets, source_rows if num_draft else None))
        source_rows += num_draft > 0
    draft_tokens = torch.randint(0, VOCAB, (source_rows + rng.randint(0, 2), width))
    for drafts, _, row in decodes:
        if row is not None:
            draft_tokens[row, :len(drafts)] = torch.tensor(drafts)
    return decodes, draft_tokens


@pytest.mark.parametrize("draw", range(40))
def test_accepted_lengths_follow_the_accept_rule_for_every_decode(draw):
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    decodes, draft_tokens = random_step(rng)
    index, input_ids, targets, expected_ids, row = DraftIndex(), [], [], [], 0
    for drafts, target_tokens, source_row in decodes:
        bonus = rng.randrange(VOCAB)
        index.add_decode(len(drafts), source_row=source_row or 0, width=draft_tokens.shape[1],
                         input_row=row, logit_row=len(targets))
        input_ids += [bonus] + [-1] * len(drafts)  # the drafts' rows hold a placeholder
        expected_ids += [bonus, *drafts]
        targets += target_tokens
        row += 1 + len(drafts)
    on_device = index.to_device("cpu")
    input_ids = torch.tensor(input_ids)
    drafts = on_device.place_drafts(draft_tokens, input_ids)
    assert input_ids.tolist() == expected_ids
    assert drafts.tolist() == [token for decode in decodes for token in decode[0]]
    accepted = on_device.accepted_lengths(drafts, torch.tensor(targets))
    assert accepted.tolist() == [accept_drafts(d, t)[0] for d, t, _ in decodes]


def test_hand_made_step():
    """Two decodes of 3 drafts (the first misses at its second draft, the second accepts all) and
    one without drafts; their bonuses at rows 0, 4 and 8."""
    index = DraftIndex()
    index.add_decode(3, source_row=0, width=4, input_row=0, logit_row=0)
    index.add_decode(3, source_row=1, width=4, input_row=4, logit_row=4)
    index.add_decode(0, source_row=2, width=4, input_row=8, logit_row=8)
    draft_tokens = torch.tensor([[7, 8, 9, 0], [1, 2, 3, 0]])
    input_ids = torch.tensor([5, 0, 0, 0, 6, 0, 0, 0, 4])
    on_device = index.to_device("cpu")
    drafts = on_device.place_drafts(draft_tokens, input_ids)
    assert input_ids.tolist() == [5, 7, 8, 9, 6, 1, 2, 3, 4]
    targets = torch.tensor([7, 4, 9, 9, 1, 2, 3, 8, 2])
    assert on_device.accepted_lengths(drafts, targets).tolist() == [1, 3, 0]


def test_drafts_past_a_decodes_limit_are_verified_but_never_accepted():
    """A decode verifying 3 drafts of which 1 may count (near its max_tokens) accepts at most 1 even
    when all 3 match; one that may count 2 but misses at its first accepts 0."""
    index = DraftIndex()
    index.add_decode(3, source_row=0, width=3, input_row=0, logit_row=0, max_accepted=1)
    index.add_decode(3, source_row=1, width=3, input_row=4, logit_row=4, max_accepted=2)
    on_device = index.to_device("cpu")
    drafts = on_device.place_drafts(torch.tensor([[7, 8, 9], [1, 2, 3]]), torch.zeros(8, dtype=torch.int64))
    targets = torch.tensor([7, 8, 9, 4, 5, 2, 3, 6])
    assert on_device.accepted_lengths(drafts, targets).tolist() == [1, 0]

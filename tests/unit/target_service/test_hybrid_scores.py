"""The hybrid's record of what the lookup would have had accepted, checked by hand."""

import random
from types import SimpleNamespace

import pytest

from target_service.proposers.hybrid import RECENT, lookup_outcome, observe


@pytest.mark.parametrize("proposal,emitted,lookup_drafted,expected", [
    # the lookup drafted: its accepted drafts, exact (the target's own token after them differs)
    ([5, 6, 7, 8], [5, 6, 9], True, (2, False)),
    ([5, 6, 7], [5, 6, 7, 4], True, (3, False)),  # all accepted, then the bonus token
    # DFlash drafted; the lookup parted from the new tokens: exact
    ([5, 6, 7, 8], [5, 9, 3], False, (1, False)),
    ([1, 2], [3], False, (0, False)),
    # DFlash drafted; the lookup agreed with every new token and proposed more: at least that many
    ([5, 6, 7, 8], [5, 6, 7], False, (3, True)),
    ([5, 6, 7, 8, 9, 10], [5], False, (1, True)),
    # ... but a proposal no longer than the new tokens was judged whole: exact
    ([5, 6], [5, 6], False, (2, False)),
    ([5, 6], [5, 6, 7], False, (2, False)),
    ([], [4, 5], False, (0, False)),  # no usable match: nothing proposed
])
def test_lookup_outcome(proposal, emitted, lookup_drafted, expected):
    assert lookup_outcome(proposal, emitted, lookup_drafted) == expected


def test_a_censored_value_raises_the_score_but_never_lowers_it():
    assert observe(None, 6, censored=True) == 6  # nothing known yet: the bound is the best guess
    assert observe(10.0, 6, censored=True) == 10.0  # "at least 6" says nothing against 10
    assert observe(4.0, 6, censored=True) == pytest.approx((1 - RECENT) * 4 + RECENT * 6)
    assert observe(10.0, 6, censored=False) == pytest.approx((1 - RECENT) * 10 + RECENT * 6)


def test_a_lookup_that_copies_keeps_its_score_while_dflash_drafts():
    """A sequence whose lookup got 15 of 15 accepted when it drafted, then DFlash steps that accept 5
    drafts, the lookup agreeing with all 6 new tokens each time: the lookup's score stays at 15, where
    counting the bound as exact pulled it to 6 within a few steps. One exact miss still lowers it."""
    score = observe(None, 15, censored=False)
    for _ in range(random.randint(3, 12)):
        emitted = list(range(6))  # DFlash's 5 accepted drafts and the target's token, all the lookup's too
        score = observe(score, *lookup_outcome(list(range(15)), emitted, lookup_drafted=False))
    assert score == 15
    missed = observe(score, *lookup_outcome([1, 2], [1, 3], lookup_drafted=False))
    assert missed == pytest.approx((1 - RECENT) * 15 + RECENT * 1)


class _Seq:
    """A sequence as the proposer reads it: its tokens so far, the newest not yet run (the bonus)."""

    def __init__(self, seq_id: int, tokens: list[int]):
        self.seq_id, self.tokens = seq_id, tokens

    @property
    def num_computed(self) -> int:
        return len(self.tokens) - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def _hybrid(num_draft: int):
    import torch

    from target_service.proposers.hybrid import HybridProposer

    drafter = SimpleNamespace(block_size=num_draft + 1, propose=lambda *args: None, settle=lambda: None,
                              store_context=lambda num_rows: None)
    buffers = SimpleNamespace(draft_tokens=torch.zeros(4, num_draft, dtype=torch.int64),
                              taps=torch.zeros(1, 8), layout=SimpleNamespace(max_context_rows=64))
    proposer = HybridProposer(drafter, buffers, min_ngram=1, max_ngram=3, min_match=2)
    proposer.stage_propose_side = lambda num_seqs: 1  # the stand-in drafter reads no step buffers
    return proposer


def _step(proposer, seq: _Seq, num_draft: int) -> str:
    proposer.stage_sequences([seq])
    proposer.propose(1, num_draft, 1)
    return proposer.sources[0]


def test_each_kind_of_lookup_match_is_scored_apart():
    """A sequence whose lookup finds only a one-token match (short: min_match 2), so DFlash drafts; the
    target then emits the first `agree` tokens of the lookup's proposal and a token never seen: the
    short matches' score is `agree` (hand-computed: the common prefix, exact as the proposal parted),
    the long matches' stays unknown, DFlash's is its `agree` accepted drafts. The next step has no
    match at all, and scores no lookup."""
    rng = random.Random()
    num_draft, agree = 7, rng.randint(0, 5)
    tokens = rng.sample(range(100, 200), 6)  # distinct: no longer match by chance
    tokens.append(tokens[2])  # its last token occurred once before (followed by tokens[3]): a 1-token match
    seq = _Seq(1, list(tokens))
    proposer = _hybrid(num_draft)
    assert _step(proposer, seq, num_draft) == "dflash"  # a short match untried counts as none: DFlash
    lookup = proposer._drafted[1].lookup
    assert lookup[:4] == tokens[3:7] and proposer._drafted[1].match == "short"
    seq.tokens += [*lookup[:agree], rng.randint(300, 400)]  # `agree` of its tokens, then one never seen
    _step(proposer, seq, num_draft)
    scores = proposer._scores[1]
    assert (scores.short, scores.long, scores.dflash) == (agree, None, agree)
    assert proposer._drafted[1].match is None  # the newest token was never seen before: no match
    seq.tokens.append(rng.randint(500, 600))
    _step(proposer, seq, num_draft)
    assert (proposer._scores[1].short, proposer._scores[1].long) == (agree, None)


def test_a_dflash_score_unobserved_is_drawn_back_toward_the_average():
    """Hand-computed: prior + (score - prior) * FORGET ** steps since observed; unknown: the prior."""
    from target_service.proposers.hybrid import FORGET, _dflash_outlook, _Scores

    rng = random.Random()
    score, prior, age = rng.uniform(0, 15), rng.uniform(0, 15), rng.randint(0, 40)
    assert _dflash_outlook(_Scores(dflash=score, dflash_age=age), prior) == pytest.approx(
        prior + (score - prior) * FORGET**age)
    assert _dflash_outlook(_Scores(dflash=score), prior) == pytest.approx(score)  # just observed: its own
    assert _dflash_outlook(_Scores(), prior) == prior


def test_dflash_s_score_ages_while_the_lookup_drafts_and_not_when_dflash_does():
    """Steps drafted by the lookup add one to the age each; a step DFlash drafted resets it, its
    score moved toward the accepted drafts (RECENT)."""
    from target_service.proposers.hybrid import LONG, _Drafted

    num_draft = 7
    proposer = _hybrid(num_draft)
    seq = _Seq(1, random.Random().sample(range(100, 200), 8))
    lookup_steps = random.randint(1, 6)
    for step in range(lookup_steps + 1):
        source = "dflash" if step == 0 else "ngram"
        proposer._drafted[1] = _Drafted(source, len(seq.tokens), [0] * num_draft, LONG)
        seq.tokens += [300 + step, 400 + step]  # one draft accepted (not the lookup's), then the target's
        proposer._learn([seq])
    scores = proposer._scores[1]
    assert (scores.dflash, scores.dflash_age) == (1, lookup_steps)
    proposer._drafted[1] = _Drafted("dflash", len(seq.tokens), [0] * num_draft, LONG)
    seq.tokens += [7, 8, 9, 10]  # three accepted
    proposer._learn([seq])
    assert (scores.dflash, scores.dflash_age) == (pytest.approx((1 - RECENT) * 1 + RECENT * 3), 0)

"""The hybrid's record of what the lookup would have had accepted, checked by hand."""

import random

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

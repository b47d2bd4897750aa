"""The incremental n-gram index proposes what a search from scratch over the whole sequence proposes,
step after step as the sequence grows, on random token streams with repeats planted in them."""

from __future__ import annotations

import random

import pytest
import torch
from ngram_reference import search_from_scratch

from target_service.proposers.ngram_index import NgramIndex


def stream(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens from a small vocabulary, with spans of earlier text copied in and periodic runs."""
    tokens = [rng.randrange(vocab)]
    while len(tokens) < length:
        kind = rng.random()
        if kind < 0.2 and len(tokens) > 4:
            start = rng.randrange(len(tokens) - 2)
            tokens += tokens[start:start + rng.randint(2, 12)]
        elif kind < 0.3:
            tokens += [rng.randrange(vocab)] * rng.randint(2, 6)
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 3), (2, 4), (1, 1), (3, 5)])
def test_the_index_proposes_what_a_search_from_scratch_proposes(min_ngram, max_ngram):
    seed = int(torch.randint(0, 2**31, ()).item())
    rng = random.Random(seed)
    for _ in range(20):
        tokens = stream(rng, rng.randint(1, 120), vocab=rng.choice([3, 8, 50]))
        index = NgramIndex(min_ngram=min_ngram, max_ngram=max_ngram)
        length = 1
        while length <= len(tokens):
            num_draft = rng.randint(1, 9)
            if rng.random() < 0.5:  # the whole sequence so far, or only what the index has not seen
                got = index.propose(tokens[:length], num_draft)
            else:
                got = index.propose_next(tokens[index.length:length], num_draft)
            assert index.length == length
            expected, ngram = search_from_scratch(tokens[:length], num_draft, max_ngram, min_ngram)
            assert (got.tokens, got.ngram) == (expected, ngram), (seed, tokens[:length], num_draft)
            length += rng.randint(1, 5)  # a step adds the accepted drafts and a bonus


def lookup(tokens: list[int], num_draft: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    return NgramIndex(min_ngram=min_ngram, max_ngram=max_ngram).propose(tokens, num_draft).tokens


def test_prompt_lookup_on_hand_made_sequences():
    # the last 3 tokens (7, 8, 9) occurred at 1..3, followed by 4, 5, then 7 8 9 again
    assert lookup([1, 7, 8, 9, 4, 5, 7, 8, 9], 3) == [4, 5, 7]
    # a match that runs into the present keeps copying its period: ... 3 4 | 3 4 3 4
    assert lookup([1, 2, 3, 4, 3, 4], 4) == [3, 4, 3, 4]
    assert lookup([5, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert lookup([5, 6, 7], 2) == [7, 7]  # no earlier occurrence of any suffix
    assert lookup([2, 9, 1, 9], 2, max_ngram=3) == [1, 9]  # falls back to a 1-gram


def test_bad_bounds_and_a_different_sequence_are_refused():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramIndex(min_ngram=3, max_ngram=2)
    index = NgramIndex(min_ngram=1, max_ngram=2)
    index.propose([1, 2, 3], 2)
    with pytest.raises(ValueError, match="different sequence"):
        index.propose([1, 2, 4, 5], 2)
    with pytest.raises(ValueError, match="num_draft"):
        index.propose([1, 2, 3, 4], 0)

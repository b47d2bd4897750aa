"""The accept rule and token choice against hand-made logits and exact distributions."""

import pytest
import torch

from target_service.engine.sampling_params import SamplingParams
from target_service.runner.sampling import accept_drafts, choose_tokens, filter_logits


@pytest.mark.parametrize(
    "drafts,target,accepted,emitted",
    [
        ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8]),  # all accepted, plus the bonus
        ([5, 9, 7], [5, 6, 7, 8], 1, [5, 6]),        # second draft wrong: target's 6 replaces it
        ([4, 6, 7], [5, 6, 7, 8], 0, [5]),           # first draft wrong
        ([], [3], 0, [3]),                           # no drafts: plain decoding
    ],
)
def test_accept_longest_matching_prefix_then_one_target_token(drafts, target, accepted, emitted):
    got = accept_drafts(drafts, target)
    assert got == (accepted, emitted)


def test_greedy_verify_of_hand_made_logits():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([2, 7, 1, 9]):
        logits[row, token] = 3.0
    target = choose_tokens(logits, SamplingParams(temperature=0))
    assert target.tolist() == [2, 7, 1, 9]
    assert accept_drafts([2, 7, 4], target.tolist()) == (2, [2, 7, 1])


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top2 = filter_logits(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(top2, torch.tensor([[0.5, 0.2, 0, 0, 0]]) / 0.7)
    nucleus = filter_logits(logits, SamplingParams(top_p=0.8))  # 0.5 + 0.2 < 0.8 <= 0.85
    torch.testing.assert_close(nucleus, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    hot = filter_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(hot, torch.softmax(logits * 2, dim=-1))


def test_one_hot_rule_emits_the_target_distribution_exactly():
    """Over all target samples, P(first emitted token) == p, whatever the draft is (exact sum)."""
    p = torch.softmax(torch.randn(6, dtype=torch.float64), dim=0)
    for draft in range(6):
        # emitted first token t0 is the target's sample; accepted iff t0 == draft
        distribution = torch.zeros(6, dtype=torch.float64)
        for t0 in range(6):
            accepted, emitted = accept_drafts([draft], [t0, 0])
            assert accepted == int(t0 == draft)
            distribution[emitted[0]] += p[t0]
        torch.testing.assert_close(distribution, p)


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(8, 50)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    first = choose_tokens(logits, params, torch.Generator().manual_seed(3))
    again = choose_tokens(logits, params, torch.Generator().manual_seed(3))
    assert torch.equal(first, again)


def test_sampling_frequencies_match_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(1, 5)
    params = SamplingParams(temperature=0.7)
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([choose_tokens(logits, params, generator) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    expected = torch.softmax(logits[0].double() / 0.7, dim=0)
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize(
    "fields", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=0), dict(stop=""),
               dict(bogus=1), dict(temperature=float("nan"))],
)
def test_bad_sampling_params_are_refused(fields):
    with pytest.raises(ValueError):
        SamplingParams(**fields)


def test_public_names_import_from_the_package():
    import target_service
    from target_service import LLM, SamplingParams
    from target_service.llm import LLM as llm_class

    assert LLM is llm_class and SamplingParams(max_tokens=3).max_tokens == 3
    with pytest.raises(AttributeError, match="no attribute"):
        target_service.NotAThing  # noqa: B018

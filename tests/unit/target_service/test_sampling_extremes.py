"""Sampling at its extremes: `filter_logits` against an independent float64 reference of temperature,
top-k and top-p on fresh random logits, every parameter's extremes included; rows that
`torch.multinomial` could refuse never leave it; and what `SamplingParams` refuses, by field.

The reference is plain Python over floats, row by row: rank the tokens by logit, keep those at or
above the k-th, weigh them exp((x - max) / T), then keep the smallest prefix (by rank) whose mass
reaches top_p, never fewer than one. Tokens whose mass before them lies within `BOUNDARY` of top_p
may go either way (fp32 rounding); every other token must be kept or dropped as the reference says.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from foundation.validation_error import describe, first_problem
from target_service.engine.sampling_params import SamplingParams
from target_service.runner.sampling import choose_tokens, filter_logits

VOCAB = 64
BOUNDARY = 1e-6
TEMPERATURES = [1e-5, 0.3, 1.0, 7.0, 1e30, 1e300]
TOP_KS = [-1, 1, 2, 17, VOCAB - 1, VOCAB, 2**62]
TOP_PS = [5e-324, 1e-300, 1e-46, 7e-46, 1e-8, 0.3, 0.9, 1 - 1e-12, 1.0]


def reference_row(logits: list[float], temperature: float, top_k: int, top_p: float):
    """(probabilities, undecided) of one row in float64: `undecided` are the tokens on top-p's edge."""
    ranked = sorted(range(len(logits)), key=lambda token: -logits[token])
    if top_k != -1 and top_k < len(logits):
        kth = logits[ranked[top_k - 1]]
        ranked = [token for token in ranked if logits[token] >= kth]
    best = logits[ranked[0]]
    weights = {token: math.exp((logits[token] - best) / temperature) for token in ranked}
    total = sum(weights.values())
    kept, undecided, before = [], set(), 0.0
    for rank, token in enumerate(ranked):
        if rank == 0 or before < top_p:
            kept.append(token)
        if rank > 0 and abs(before - top_p) <= BOUNDARY:
            undecided.add(token)
        before += weights[token] / total
    mass = sum(weights[token] for token in kept)
    probs = [0.0] * len(logits)
    for token in kept:
        probs[token] = weights[token] / mass
    return probs, undecided


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("top_p", TOP_PS)
def test_filter_logits_equals_a_float64_reference_at_every_extreme(temperature, top_k, top_p):
    logits = torch.randn(3, VOCAB) * 4
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = filter_logits(logits, params).double()
    for row in range(logits.shape[0]):
        expected, undecided = reference_row(logits[row].double().tolist(), temperature, top_k, top_p)
        expected = torch.tensor(expected, dtype=torch.float64)
        decided = torch.tensor([token not in undecided for token in range(VOCAB)])
        assert torch.equal((ours[row] > 0)[decided], (expected > 0)[decided]), (row, undecided)
        if not undecided:
            torch.testing.assert_close(ours[row], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46, 7e-46, 1e-20])
def test_a_top_p_below_fp32_range_keeps_the_most_likely_token(top_p):
    """The issue's request (top_p 1e-46) once dropped every token and made multinomial raise."""
    logits = torch.randn(5, 1000)
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
    probs = filter_logits(logits, params)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 1000).float())
    assert torch.equal(choose_tokens(logits, params, torch.Generator().manual_seed(0)), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-45, 1e-30])
def test_a_temperature_towards_zero_is_greedy(temperature):
    logits = torch.randn(4, 50)
    argmax = logits.argmax(-1)
    probs = filter_logits(logits, SamplingParams(temperature=temperature))  # the limit, computed
    assert torch.equal(probs, torch.nn.functional.one_hot(argmax, 50).float())
    assert torch.equal(choose_tokens(logits, SamplingParams(temperature=temperature)), argmax)


@pytest.mark.parametrize("temperature", [1e30, 1e300, 1.7976931348623157e308])
def test_a_huge_temperature_is_uniform_over_what_the_filters_keep(temperature):
    logits = torch.randn(2, 40) * 10
    probs = filter_logits(logits, SamplingParams(temperature=temperature, top_k=8))
    kept = logits >= logits.topk(8).values[:, -1:]
    torch.testing.assert_close(probs, kept.float() / 8)


POISONED_ROWS = [
    [float("nan")] * 6,
    [float("-inf")] * 6,
    [float("inf"), float("inf"), 0.0, -1.0, float("nan"), 2.0],
    [3.4e38, -3.4e38, 3.4e38, 0.0, float("-inf"), 1.0],
    [-3.4e38] * 5 + [float("nan")],
    [1e-45, 0.0, -1e-45, 5.0, 5.0, float("-inf")],
]


@pytest.mark.parametrize("row", POISONED_ROWS)
@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=1e-5, top_p=1e-46),
    SamplingParams(temperature=1e30, top_k=2), SamplingParams(temperature=0.7, top_k=3, top_p=0.5),
])
def test_any_logits_give_a_distribution_multinomial_takes(row, params):
    """Whatever the model hands over (NaN, +-inf, fp32's extremes), each row is finite, >= 0, sums to 1
    and keeps a token of the largest logit (NaN counting as -inf)."""
    logits = torch.tensor([row])
    probs = filter_logits(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))
    clean = logits.nan_to_num(nan=float("-inf"), posinf=3.4e38)
    assert probs[0][clean[0] == clean[0].max()].sum() > 0
    token = choose_tokens(logits, params, torch.Generator().manual_seed(1))
    assert probs[0, token] > 0


@pytest.mark.parametrize("fields,field", [
    (dict(top_p=float("nan")), "top_p"), (dict(top_p=0.0), "top_p"), (dict(top_p=-1e-300), "top_p"),
    (dict(top_p=1.0000001), "top_p"), (dict(temperature=-5e-324), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"), (dict(seed=2**64), "seed"),
])
def test_out_of_range_parameters_are_refused_in_one_line_naming_the_field(fields, field):
    with pytest.raises(ValidationError) as caught:
        SamplingParams(**fields)
    assert first_problem(caught.value)[0] == field
    line = describe(caught.value)
    assert line.startswith(f"{field}: ") and "\n" not in line


@pytest.mark.parametrize("fields", [
    dict(top_p=5e-324), dict(temperature=5e-324), dict(temperature=1e300), dict(top_k=1), dict(top_k=2**70),
    dict(seed=0), dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(seed=-1),
])
def test_extremes_that_can_be_computed_are_accepted(fields):
    params = SamplingParams(**fields)
    assert all(getattr(params, name) == value for name, value in fields.items())

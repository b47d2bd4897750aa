"""TokenConstraint against fresh llguidance matchers: row j's mask is the grammar's after the block's
first j drafts, rows past a rejected draft allow everything, a rejected draft is replaced by the
token the grammar forces there, and neither walk moves the state that the emitted tokens set."""

from __future__ import annotations

import random

import llguidance
import pytest
import torch
from grammar_helpers import EOS, SPECS, write_byte_tokenizer
from tokenizers import Tokenizer

from target_service.structured.vocabulary import GrammarVocabulary

VOCAB = 320
MODEL_VOCAB = 384  # wider than the tokenizer's, as padded embeddings are


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(directory, VOCAB)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def fresh_mask(tokenizer, spec, prefix: list[int]) -> torch.Tensor:
    lltok = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=[EOS])
    matcher = llguidance.LLMatcher(lltok, spec.grammar_text(), log_level=0)
    assert matcher.consume_tokens(prefix) if prefix else True
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    allowed = torch.zeros(MODEL_VOCAB, dtype=torch.bool)
    allowed[: min(bias.numel(), MODEL_VOCAB)] = bias[:MODEL_VOCAB] > 0
    return allowed


def valid_walk(constraint, steps: int, rng: random.Random) -> list[int]:
    """Random tokens the grammar allows, one after another (without moving `constraint`)."""
    tokens = []
    for _ in range(steps):
        allowed = constraint.masks(tokens)[-1].nonzero().flatten().tolist()
        allowed = [token for token in allowed if token != EOS]
        if not allowed:
            break
        tokens.append(rng.choice(allowed))
    return tokens


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_each_rows_mask_is_the_grammars_after_the_drafts_before_it(tokenizer, kind):
    rng = random.Random()
    vocabulary = GrammarVocabulary(tokenizer, [EOS], MODEL_VOCAB)
    spec = SPECS[kind]
    constraint = vocabulary.constraint(spec)
    emitted = valid_walk(constraint, rng.randint(0, 3), rng)
    for token in emitted:
        assert constraint.advance(token)
    drafts = valid_walk(constraint, 4, rng)
    cut = rng.randint(0, len(drafts))
    bad = (~fresh_mask(tokenizer, spec, emitted + drafts[:cut])[:VOCAB]).nonzero().flatten().tolist()
    block = [*drafts[:cut], rng.choice(bad), *drafts[cut:]] if bad else drafts
    masks = constraint.masks(block)
    rejected = cut if bad else len(block)
    for row in range(len(block) + 1):
        if row <= rejected:
            assert torch.equal(masks[row], fresh_mask(tokenizer, spec, emitted + block[:row])), row
        else:
            assert masks[row].all()
    assert not masks[: rejected + 1, VOCAB:].any()  # past the tokenizer: never allowed
    assert torch.equal(constraint.masks([])[0], fresh_mask(tokenizer, spec, emitted))  # state unmoved


def test_a_rejected_draft_becomes_the_token_the_grammar_forces(tokenizer):
    vocabulary = GrammarVocabulary(tokenizer, [EOS], MODEL_VOCAB)
    constraint = vocabulary.constraint(SPECS["json"])  # {"name": ... is forced from the start
    junk = int((~fresh_mask(tokenizer, SPECS["json"], [])[3:VOCAB]).nonzero()[0]) + 3
    repaired = constraint.repair([junk] * 4)
    text = tokenizer.decode(repaired)
    assert '{"name": "'.startswith(text) or text.startswith('{"name"'), text
    assert all(fresh_mask(tokenizer, SPECS["json"], repaired[:i])[t] for i, t in enumerate(repaired))
    assert torch.equal(constraint.masks([])[0], fresh_mask(tokenizer, SPECS["json"], []))  # unmoved
    unforced = vocabulary.constraint(SPECS["choice"])  # yes / no / maybe: nothing is forced at first
    assert unforced.repair([junk, junk]) == [junk, junk]

"""Structured outputs under speculation: greedy constrained output is the same token for token with
the DFlash drafter, with the hybrid proposer and without any, and equals constrained greedy decoding
done apart from the engine (HF transformers' logits, llguidance's own matcher); every output that
stopped matches its spec by a check that does not use llguidance (json.loads + jsonschema, re); a
constrained request beside unconstrained ones changes none of their tokens; a spec that does not
compile is refused in one line before anything is queued."""

from __future__ import annotations

import random

import pytest
from engine_helpers import chi_square_against, make_pair, random_prompts
from grammar_helpers import CORPUS, SPECS, assert_matches, grammar_pair, reference_greedy

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.structured.params import StructuredOutputsParams

SETTINGS = dict(kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8, max_model_len=192)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return grammar_pair(tmp_path_factory.mktemp("grammar"))


def engine(pair, method: str) -> LLM:
    target, drafter = pair
    if method == "plain":
        return LLM(target, **SETTINGS)
    return LLM(target, drafter, speculative_method=method, num_speculative_tokens=5, **SETTINGS)


def constrained(spec, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=spec, **fields)


def prompts_with_a_long_answer(target, spec, tries: int = 20):
    """Three random prompts and their reference outputs, one of them at least 3 tokens long.

    A grammar can close within two tokens (``{}``, ``no``); when every answer of a draw is that short no step
    decodes, nothing is drafted, and the speculative half of the test would check nothing.
    """
    for _ in range(tries):
        prompts = random_prompts(3, 320, low=3, high=12)
        expected = [reference_greedy(target, prompt, spec, MAX_TOKENS) for prompt in prompts]
        if max(map(len, expected)) >= 3:
            return prompts, expected
    raise AssertionError(f"{tries} draws of prompts all closed {spec} within 3 tokens")


@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_greedy_is_the_reference_with_and_without_speculation(pair, kind):
    spec = SPECS[kind]
    prompts, expected = prompts_with_a_long_answer(pair[0], spec)
    for method in ("plain", "dflash", "hybrid"):
        llm = engine(pair, method)
        try:
            results = llm.generate(prompts, constrained(spec))
            assert [r.outputs[0].token_ids for r in results] == expected, method
            for result in results:
                assert_matches(spec, result.outputs[0].text, result.outputs[0].finish_reason)
            if method != "plain":
                assert llm.stats.num_drafts > 0
        finally:
            llm.close()


def test_a_constrained_request_leaves_its_batch_unchanged(pair):
    prompts = random_prompts(4, 320, low=3, high=20)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = engine(pair, "dflash")
    try:
        alone = [r.outputs[0].token_ids for r in llm.generate(prompts, free)]
        kinds = random.sample(list(SPECS), 2)
        mixed = llm.generate(prompts + prompts[:2], [free] * 4 + [constrained(SPECS[k]) for k in kinds])
        assert [r.outputs[0].token_ids for r in mixed[:4]] == alone
        for kind, result in zip(kinds, mixed[4:]):
            assert result.outputs[0].token_ids == reference_greedy(pair[0], prompts[kinds.index(kind)],
                                                                   SPECS[kind], MAX_TOKENS)
        usage = llm.engine.pool_usage()
        assert usage.num_used_blocks == 0 and usage.num_seqs == 0
    finally:
        llm.close()


@pytest.mark.parametrize("spec,message", [
    (StructuredOutputsParams(regex="(["), "the regex does not compile"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "the grammar does not compile"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "the json does not compile"),
    (StructuredOutputsParams(grammar=""), "the grammar is not valid: as GBNF: No 'root' rule found"),
    (StructuredOutputsParams(grammar='x ::= "a"\nroot ::= x y'), "not valid: as GBNF: Rule 'y' not found"),
])
def test_a_spec_that_does_not_compile_is_refused_before_anything_is_queued(pair, spec, message):
    llm = engine(pair, "dflash")
    try:
        with pytest.raises(ValueError, match=message) as caught:
            llm.engine.add_request("bad", [5, 6, 7], constrained(spec))
        assert "\n" not in str(caught.value) and llm.engine.num_requests == 0
        prompt = random_prompts(1, 320)[0]
        answer = llm.generate([prompt], constrained(SPECS["choice"]))[0].outputs[0].text
        assert answer in ("yes", "no", "maybe")
    finally:
        llm.close()


@pytest.mark.parametrize("fields,message", [
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(choice=[]), "choice needs 1 to"),
    (dict(regex="a" * 70_000), "at most 65536"),
    (dict(json="{not json"), "json is not valid JSON"),
])
def test_bad_specs_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_a_tokenizer_grammars_cannot_read_refuses_structured_outputs_alone(tmp_path):
    """A word-level tokenizer without a decoder: a constrained request is refused in one line, and the
    engine serves everything else as before."""
    target, _ = make_pair(tmp_path, tokenizer=True)
    llm = LLM(target, **SETTINGS)
    try:
        with pytest.raises(ValueError, match="tokenizer cannot be read for grammars") as caught:
            llm.generate([[5, 6, 7]], constrained(SPECS["regex"]))
        assert "\n" not in str(caught.value) and llm.engine.num_requests == 0
        free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        assert len(free[0].outputs[0].token_ids) == 5
    finally:
        llm.close()


def write_ascii_tokenizer(directory, vocab_size: int) -> None:
    """A byte-level BPE trained on the (ASCII) corpus without the full byte alphabet: no token holds
    a byte above 0x7F, so no output can contain a non-ASCII character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert all(ord(char) < 0x80 for char in tokenizer.decode(list(range(3, tokenizer.get_vocab_size()))))
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_no_token_can_continue_ends_its_request_with_stop_and_the_batch_serves_on(tmp_path,
                                                                                          ignore_eos):
    """No token of this tokenizer holds a byte above 0x7F, so the grammar `abÀ` cannot be completed:
    once no token can continue it, the mask allows only end-of-sequence, and the request ends there
    with "stop" (with ignore_eos too: it cannot go on), the rest of its batch untouched and the
    engine serving."""
    target, drafter = make_pair(tmp_path, vocab_size=200)
    write_ascii_tokenizer(tmp_path / "target", 200)
    llm = LLM(target, drafter, num_speculative_tokens=5, **SETTINGS)
    try:
        prompts = random_prompts(3, 200)
        free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        alone = [out.outputs[0].token_ids for out in llm.generate(prompts[1:], free)]
        dead_end = constrained(StructuredOutputsParams(regex="abÀ"), ignore_eos=ignore_eos)
        outs = llm.generate(prompts, [dead_end, free, free])
        ended = outs[0].outputs[0]
        assert ended.finish_reason == "stop"
        assert "ab".startswith(ended.text)  # a prefix of what can be written (llguidance may see the
        assert len(ended.token_ids) <= 3  # dead end before "b"), then at most the end-of-sequence
        assert [out.outputs[0].token_ids for out in outs[1:]] == alone
        assert llm.generate(prompts[1:], free)[0].outputs[0].token_ids == alone[0]  # serving on
        assert llm.engine.pool_usage().num_used_blocks == 0
    finally:
        llm.close()


def write_letter_tokenizer(directory, letters: str) -> None:
    """A byte-level BPE with no merges: token 3 + i is the letter `letters[i]` alone, after the
    three specials, so a regex over letters allows exactly the token ids of those letters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{letter: 3 + i for i, letter in enumerate(letters)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


SAMPLED_VOCAB, SAMPLED_TEMPERATURE, ALLOWED = 12, 0.6, "abcde"  # ids 3..7 of letters a..i (3..11)


def test_constrained_samples_with_a_drafter_follow_the_masked_target_distribution(tmp_path):
    """Sampling keeps the constrained distribution under speculation: with the regex `[abcde]{3}`,
    the 2nd and 3rd sampled tokens (the 3rd from the verify row after an accepted or rejected draft)
    follow the target's distribution restricted to the five letters and renormalised, computed by
    brute force in float64 (one forward per prefix); the engine's counts over many seeds by a
    chi-square test (p = 0.001)."""
    import torch

    from target_service.runner.forward_batch import SeqChunk, pack

    target, drafter = make_pair(tmp_path, vocab_size=SAMPLED_VOCAB, hidden_size=32, intermediate_size=48)
    write_letter_tokenizer(tmp_path / "target", "abcdefghi")
    llm = LLM(target, drafter, num_speculative_tokens=3, kv_cache_memory="8MiB", tokens_per_block=16,
              max_num_seqs=256, max_model_len=64)
    allowed = torch.tensor([3 + "abcdefghi".index(letter) for letter in ALLOWED])

    def masked_probs(tokens: list[int]) -> torch.Tensor:
        model = llm.assembly.runner.target
        shape = (4, 16, model.config.num_key_value_heads, model.config.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.config.num_hidden_layers)]
        logits = model(pack([SeqChunk(tokens, 0, [0, 1, 2, 3], 1, 0)], 16), caches).logits[0].double()
        probs = torch.zeros(SAMPLED_VOCAB, dtype=torch.float64)
        probs[allowed] = torch.softmax(logits[allowed] / SAMPLED_TEMPERATURE, dim=-1)
        return probs

    try:
        prompt = torch.randint(3, SAMPLED_VOCAB, (6,)).tolist()
        first = masked_probs(prompt)
        joint = torch.zeros(SAMPLED_VOCAB, SAMPLED_VOCAB, dtype=torch.float64)  # P(2nd = b, 3rd = c)
        for a in allowed.tolist():
            second = masked_probs([*prompt, a])
            for b in allowed.tolist():
                joint[b] += first[a] * second[b] * masked_probs([*prompt, a, b])

        num_runs, spec = 2000, StructuredOutputsParams(regex=f"[{ALLOWED}]{{3}}")
        seeds = torch.randint(0, 2**31, (num_runs,)).tolist()
        params = [SamplingParams(max_tokens=3, temperature=SAMPLED_TEMPERATURE, seed=seed,
                                 structured_outputs=spec) for seed in seeds]
        counts = torch.zeros(SAMPLED_VOCAB, SAMPLED_VOCAB, dtype=torch.float64)
        for start in range(0, num_runs, 250):
            for out in llm.generate([prompt] * 250, params[start:start + 250]):
                _, b, c = out.outputs[0].token_ids
                counts[b, c] += 1
        assert llm.stats.num_drafts > 0 and counts.sum() == num_runs
        assert counts[~joint.gt(0)].sum() == 0  # nothing outside the grammar, ever

        chi2, critical = chi_square_against(counts, joint * num_runs)
        assert chi2 < critical, chi2
    finally:
        llm.close()

"""Sampling with a drafter keeps the target's distribution, and a seed makes it reproducible.

The oracle is exact: on a tiny vocabulary the test computes, by brute force (one forward per
prefix, float64 softmax), the target's joint distribution of the 2nd and 3rd sampled tokens. The
3rd token is where the draft matters: it is the target's sample at the draft's row when the draft
was accepted. The engine's counts over many seeds are compared with a chi-square test.
"""

import pytest
import torch
from engine_helpers import chi_square_against, make_pair

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.runner.forward_batch import SeqChunk, pack

VOCAB = 12
TEMPERATURE = 0.6


def next_token_probs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The target's next-token distribution after `tokens`, through a scratch page set."""
    target = llm.assembly.runner.target
    config = target.config
    shape = (4, 16, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    batch = pack([SeqChunk(tokens, 0, [0, 1, 2, 3], 1, 0)], 16)
    logits = target(batch, caches).logits[0].double()
    return torch.softmax(logits / TEMPERATURE, dim=-1)


@pytest.mark.parametrize("method", ["dflash", "ngram", "hybrid", "dflash-adaptive"])
def test_sampled_pairs_with_a_drafter_follow_the_target_distribution(tmp_path, method):
    """Whoever proposes (the drafter, prompt lookup, or either per step) and however many drafts a
    step verifies (adaptive: 0, 1 or 3), the verify samples the target at every row and accepts the
    drafts equal to its samples: the target's distribution."""
    target, drafter = make_pair(tmp_path, vocab_size=VOCAB, hidden_size=32, intermediate_size=48)
    prompt = torch.randint(3, VOCAB, (6,)).tolist()
    adaptive, proposer = method == "dflash-adaptive", method.removesuffix("-adaptive")
    llm = LLM(target, None if method == "ngram" else drafter, speculative_method=proposer,
              num_speculative_tokens=3, adaptive_speculation=adaptive or None, kv_cache_memory="8MiB",
              tokens_per_block=16, max_num_seqs=256, max_model_len=64)
    first = next_token_probs(llm, prompt)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)  # P(2nd = b, 3rd = c)
    for a in range(VOCAB):
        second = next_token_probs(llm, [*prompt, a])
        for b in range(VOCAB):
            joint[b] += first[a] * second[b] * next_token_probs(llm, [*prompt, a, b])

    num_runs = 3000
    # max_tokens 3: one draft after the first token, verified in the step that yields tokens 2 and 3
    params = [SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True, seed=seed)
              for seed in torch.randint(0, 2**31, (num_runs,)).tolist()]
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for start in range(0, num_runs, 250):
        for out in llm.generate([prompt] * 250, params[start:start + 250]):
            _, b, c = out.outputs[0].token_ids
            counts[b, c] += 1
    assert llm.stats.num_drafts > 0  # the speculative path produced the second tokens
    if adaptive:
        assert len(llm.engine.counters().decode_steps_by_drafts) >= 2  # more than one k was verified

    chi2, critical = chi_square_against(counts, joint * num_runs)
    assert chi2 < critical, chi2
    llm.close()


def test_a_seed_reproduces_the_same_sample_whatever_the_batch(tmp_path):
    target, drafter = make_pair(tmp_path)
    prompt = torch.randint(3, 160, (9,)).tolist()
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    llm = LLM(target, drafter, num_speculative_tokens=3, kv_cache_memory="4MiB", tokens_per_block=16,
              max_num_seqs=8, max_model_len=128)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    crowded = llm.generate([prompt, [5, 6, 7], [9] * 20], [seeded, others, others])[0].outputs[0].token_ids
    assert alone == crowded
    llm.close()

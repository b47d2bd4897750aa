"""The start-up warm-up: a ladder of row counts reaching the step's largest, one forward per rung over
the pool's first pages and no others, and the pages it wrote are rewritten by a request before it
reads them (its greedy tokens equal those of a target that never warmed up)."""

from __future__ import annotations

import random

import pytest
import torch

from target_service.runner.checkpoint import load_target, open_target_checkpoint
from target_service.runner.forward_batch import SeqChunk, pack
from target_service.runner.warm_up import ladder, warm_up_forwards
from tests.tiny_checkpoints import write_target_checkpoint

TOKENS_PER_BLOCK = 16


def test_the_ladder_climbs_by_a_quarter_to_its_top():
    high = random.randint(20, 5000)
    rungs = ladder(1, high)
    assert rungs[0] == 1 and rungs[-1] == high and rungs == sorted(set(rungs))
    for i in range(len(rungs) - 2):  # every step but the last, which stops at high
        assert rungs[i + 1] == max(rungs[i] + 1, int(rungs[i] * 1.25))
    assert ladder(7, 7) == [7]
    with pytest.raises(ValueError, match=r"1 <= low <= high, got 5\.\.4"):
        ladder(5, 4)


def caches_for(config, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, TOKENS_PER_BLOCK, config.num_key_value_heads, config.head_dim)
    return [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(config.num_hidden_layers)]


def greedy(target, caches, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding of `prompt` over blocks 0.. of `caches`, one forward per token."""
    tokens, blocks = list(prompt), list(range(len(caches[0][0])))
    out = target(pack([SeqChunk(tokens, 0, blocks)], TOKENS_PER_BLOCK), caches)
    for _ in range(steps):
        tokens.append(int(out.logits[-1].argmax()))
        out = target(pack([SeqChunk(tokens[-1:], len(tokens) - 1, blocks)], TOKENS_PER_BLOCK), caches)
    return tokens[len(prompt):]


def test_warm_up_writes_only_the_first_pages_and_changes_no_answer(tmp_path):
    write_target_checkpoint(tmp_path, seed=random.randint(0, 10_000))
    target, _ = load_target(open_target_checkpoint(tmp_path), dtype=torch.float32, tap_layer_ids=[1])
    max_rows, num_blocks = random.randint(40, 90), 12
    caches = caches_for(target.config, num_blocks)
    forwards = warm_up_forwards(target, caches, tokens_per_block=TOKENS_PER_BLOCK, max_rows=max_rows,
                                max_logits=random.randint(1, 50))
    assert forwards == len(ladder(1, max_rows))
    for k_cache, v_cache in caches:
        for cache in (k_cache, v_cache):
            positions = cache.flatten(0, 1)  # the pages in a row: position p of the largest rung at p
            assert not positions[:max_rows].isnan().any()  # the largest rung wrote its positions
            assert positions[max_rows:].isnan().all()  # and nothing past them
    prompt = [random.randrange(target.config.vocab_size) for _ in range(random.randint(5, 60))]
    fresh = caches_for(target.config, num_blocks)
    assert greedy(target, caches, prompt, 8) == greedy(target, fresh, prompt, 8)

"""Dense KV-cached generation (the drafter's training text) against HF transformers, recomputed.

The reference runs the HF Qwen3 model of the same checkpoint over the whole sequence at every step
and takes the argmax of the last position: no cache, no shared code with `dense_generate`.
"""

import os

import pytest
import torch
from tiny_checkpoints import write_target_checkpoint

from training.dense_generate import cut_at_eos, generate_batch, generate_continuations
from training.train_drafter import load_frozen_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 160


@pytest.fixture
def checkpoint(tmp_path):
    seed = int(torch.randint(0, 2**31, ()).item())
    return write_target_checkpoint(tmp_path / "t", "qwen3", seed=seed, tokenizer=True, vocab_size=VOCAB)


def hf_greedy(directory, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    ids = prompts.clone()
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1]:]


def test_greedy_continuations_equal_hf_recomputed_every_step(checkpoint):
    model, _ = load_frozen_target(str(checkpoint), torch.device("cpu"))
    prompts = torch.randint(2, VOCAB, (5, int(torch.randint(1, 12, ()).item())))
    got = generate_batch(model, prompts, 9)
    assert torch.equal(got, hf_greedy(checkpoint, prompts, 9))


def test_batching_and_eos_cut_match_one_prompt_at_a_time(checkpoint):
    model, _ = load_frozen_target(str(checkpoint), torch.device("cpu"))
    prompts = torch.randint(2, VOCAB, (7, 6)).tolist()
    whole = generate_batch(model, torch.tensor(prompts), 8)
    eos = int(whole[3, 4])  # a token row 3 emits: its row stops there, others wherever it appears
    got = generate_continuations(model, prompts, max_tokens=8, temperature=0.0, eos_id=eos, seed=0, batch=3)
    singly = [generate_batch(model, torch.tensor([p]), 8)[0].tolist() for p in prompts]
    for row, one in zip(got, singly):
        assert row == (one[: one.index(eos) + 1] if eos in one else one)
    assert len(got[3]) <= 5 and got[3][-1] == eos


def test_near_zero_temperature_samples_the_argmax(checkpoint):
    model, _ = load_frozen_target(str(checkpoint), torch.device("cpu"))
    prompts = torch.randint(2, VOCAB, (4, 5))
    sampled = generate_batch(model, prompts, 6, temperature=1e-6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampled, generate_batch(model, prompts, 6))


def test_cut_at_eos_keeps_rows_without_eos_whole():
    rows = torch.tensor([[5, 0, 7], [4, 4, 4]])
    assert cut_at_eos(rows, 0) == [[5, 0], [4, 4, 4]]
    assert cut_at_eos(rows, None) == [[5, 0, 7], [4, 4, 4]]


@pytest.mark.parametrize("prompts, max_tokens, message", [
    (torch.zeros(3, dtype=torch.long), 4, "prompts must be"),
    (torch.zeros(2, 3, dtype=torch.long), 0, "max_tokens must be"),
    (torch.zeros(1, 500, dtype=torch.long), 100, "max_position_embeddings"),
])
def test_bad_generation_requests_are_refused(checkpoint, prompts, max_tokens, message):
    model, _ = load_frozen_target(str(checkpoint), torch.device("cpu"))
    with pytest.raises(ValueError, match=message):
        generate_batch(model, prompts, max_tokens)


def test_prompts_of_different_lengths_are_refused(checkpoint):
    model, _ = load_frozen_target(str(checkpoint), torch.device("cpu"))
    with pytest.raises(ValueError, match="one length"):
        generate_continuations(model, [[3, 4], [5]], max_tokens=2, temperature=0.0, eos_id=None, seed=0,
                               batch=2)

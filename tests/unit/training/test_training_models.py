"""The training forwards against independent references.

- DenseQwen3 against HF transformers' Qwen3 on the same checkpoint (logits, and taps = HF
  hidden_states[i + 1], final-normed on the last layer as the serving target does).
- The DFlash training forward against the serving path: the exported drafter, loaded by
  drafter_service, projects the context into pages we allocate here and proposes each block;
  its logits must equal the training forward's block logits (fp32, tight).
- A few optimizer steps overfit one fixed batch (target and drafter).
"""

import os

import pytest
import torch
from tiny_checkpoints import write_target_checkpoint

from drafter_service.checkpoint import load_drafter
from drafter_service.draft_batch import DraftBatch
from foundation.checkpoint_config import DrafterConfig, TargetConfig, load_target_config
from target_service.runner.model import target_weight_layout
from training.anchors import build_blocks, sample_anchors, weighted_block_loss
from training.dense_drafter import DenseDFlashDrafter
from training.dense_target import DenseQwen3, causal_lm_loss
from training.export import drafter_config_json, export_drafter, target_config_json
from training.optim import make_optimizer
from training.train_drafter import load_frozen_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, MASK, TOKENS_PER_BLOCK = 300, 1, 16


def tiny_target_json(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                  eos_token_id=0, dtype="float32")
    return target_config_json(**{**fields, **overrides})


def perturbed(module, seed):
    """Random weights everywhere, norms included (a norm applied with the wrong weight must show)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return module


def test_dense_target_matches_hf_qwen3(tmp_path):
    from transformers import AutoModelForCausalLM

    seed = int(torch.randint(0, 2**31, ()).item())
    directory = write_target_checkpoint(tmp_path / "t", "qwen3", seed=seed, tokenizer=True, vocab_size=160)
    model, _ = load_frozen_target(str(directory), torch.device("cpu"))
    assert set(model.state_dict()) == set(target_weight_layout(load_target_config(directory)))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, 160, (2, 13))
    with torch.no_grad():
        expected = hf(ids, output_hidden_states=True)
        out, taps = model.hidden(ids, [0, 3])
        logits = model(ids)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-4, atol=1e-4)
    hidden = expected.hidden_states  # [0] embeddings; [i + 1] layer i; the last one final-normed
    torch.testing.assert_close(taps, torch.cat([hidden[1], hidden[4]], -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, hidden[4], rtol=1e-4, atol=1e-4)


def test_training_forward_equals_the_paged_serving_drafter(tmp_path):
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    target_json = tiny_target_json()
    target = perturbed(DenseQwen3(TargetConfig.model_validate(target_json)), seed).eval()
    drafter_json = drafter_config_json(target_json, num_layers=2, block_size=8, mask_token_id=MASK,
                                       target_layer_ids=[0, 2], intermediate_size=80, dtype="float32")
    drafter = perturbed(DenseDFlashDrafter(DrafterConfig.model_validate(drafter_json)), seed + 1).eval()
    ids, lengths = torch.randint(2, VOCAB, (2, 40)), torch.tensor([40, 29])
    loss_mask = torch.ones(2, 40, dtype=torch.bool)
    anchors, keep = sample_anchors(lengths, loss_mask, 5)
    anchors[0, 0] = 0  # an anchor with an empty context
    blocks = build_blocks(ids, lengths, loss_mask, anchors, keep, block_size=8, mask_token_id=MASK, gamma=4.0)
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head_weight.detach()
    with torch.no_grad():
        _, taps = target.hidden(ids, [0, 2])
        trained = drafter(taps, blocks, embed, lm_head)  # [b, n, 7, V]

    serving = load_drafter(export_drafter(tmp_path / "d", drafter, drafter_json, max_shard_bytes=1 << 16),
                           TargetConfig.model_validate(target_json), dtype="float32", progress=False)
    arena = torch.zeros(6, 2, 2, TOKENS_PER_BLOCK, 2, 16)  # [blocks, L, K/V, tokens, NKV, D]
    caches = [(arena[:, i, 0], arena[:, i, 1]) for i in range(2)]
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)  # scattered pages
    for b in range(2):
        for j in range(anchors.shape[1]):
            anchor = int(anchors[b, j])
            arena.zero_()
            positions = torch.arange(anchor)
            pages = table[0, positions // TOKENS_PER_BLOCK].long()
            slots = pages * TOKENS_PER_BLOCK + positions % TOKENS_PER_BLOCK
            serving.project_context(taps[b, :anchor], positions, slots, caches)
            batch = DraftBatch(bonus_tokens=ids[b, anchor:anchor + 1], start_positions=torch.tensor([anchor]),
                               block_table=table, ctx_lens=torch.tensor([anchor], dtype=torch.int32))
            proposal = serving.propose(batch, caches, embed, lm_head, 7, return_logits=True)
            torch.testing.assert_close(proposal.logits[0], trained[b, j], rtol=1e-5, atol=2e-5)


def test_a_few_steps_overfit_a_fixed_batch():
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    target_json = tiny_target_json(num_layers=2)
    target = DenseQwen3(TargetConfig.model_validate(target_json))
    ids = torch.randint(2, VOCAB, (2, 24))
    optimizer, schedule = make_optimizer(target, lr=1e-2, weight_decay=0.0, total_steps=40, warmup_steps=2)
    losses = []
    for _ in range(40):
        loss = causal_lm_loss(target, ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]

    target.requires_grad_(False)
    drafter_json = drafter_config_json(target_json, num_layers=1, block_size=4, mask_token_id=MASK,
                                       target_layer_ids=[0, 1], intermediate_size=64, dtype="float32")
    drafter = DenseDFlashDrafter(DrafterConfig.model_validate(drafter_json))
    lengths, loss_mask = torch.tensor([24, 24]), torch.ones(2, 24, dtype=torch.bool)
    anchors, keep = sample_anchors(lengths, loss_mask, 6)
    blocks = build_blocks(ids, lengths, loss_mask, anchors, keep, block_size=4, mask_token_id=MASK, gamma=2.0)
    _, taps = target.hidden(ids, [0, 1])
    steps = 150  # the drafter sees the fixed batch through random anchors: give it time to memorise
    optimizer, schedule = make_optimizer(drafter, lr=1e-2, weight_decay=0.0, total_steps=steps,
                                         warmup_steps=2)
    first = None
    for _ in range(steps):
        logits = drafter(taps, blocks, target.model.embed_tokens.weight, target.lm_head_weight)
        loss, accuracy = weighted_block_loss(logits, blocks.labels, blocks.weights)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    assert loss.item() < 0.2 * first and accuracy.item() > 0.9


def test_drafter_forward_refuses_taps_of_the_wrong_width():
    target_json = tiny_target_json()
    drafter_json = drafter_config_json(target_json, num_layers=1, block_size=4, mask_token_id=MASK,
                                       target_layer_ids=[0, 2], intermediate_size=64, dtype="float32")
    drafter = DenseDFlashDrafter(DrafterConfig.model_validate(drafter_json))
    ids = torch.randint(2, VOCAB, (1, 8))
    blocks = build_blocks(ids, torch.tensor([8]), torch.ones(1, 8, dtype=torch.bool), torch.tensor([[2]]),
                          torch.tensor([[True]]), block_size=4, mask_token_id=MASK, gamma=2.0)
    with pytest.raises(ValueError, match=r"taps must be \[b, S, 128\]"):
        drafter(torch.zeros(1, 8, 64), blocks, torch.zeros(VOCAB, 64), torch.zeros(VOCAB, 64))

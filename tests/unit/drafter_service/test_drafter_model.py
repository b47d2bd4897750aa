"""The paged DFlash drafter against a dense float64 DFlash written here, over steps of context growth.

Our side is the serving path: the paged target's taps -> project_context into draft pages ->
propose. The oracle takes HF transformers' hidden states of the same target, concatenates all
context K/V with the noise block's and runs non-causal SDPA, straight from the checkpoint tensors.
"""

import copy
import os
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from drafter_service.checkpoint import load_drafter
from drafter_service.draft_batch import DraftBatch
from target_service.runner.checkpoint import load_target
from target_service.runner.forward_batch import SeqChunk, pack
from tests.tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENS_PER_BLOCK = 16
TAPS = [1, 2]
# two sequences: context lengths after each commit (steps of 1 and many tokens, across a page edge)
CONTEXT_LENGTHS = [(19, 8), (23, 16), (24, 17), (33, 20)]
DRAFTS_PER_STEP = [7, 3, 7, 5]


# ---- the independent dense float64 DFlash -----------------------------------------------------


def rms(x, weight, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta):
    """x [N, heads, D] float64; NeoX halves as complex pairs rotated by pos * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    phase = torch.exp(1j * positions.double()[:, None, None] * freqs)
    z = torch.complex(x[..., :half], x[..., half:]) * phase
    return torch.cat([z.real, z.imag], dim=-1)


def dense_draft_logits(w, cfg, taps, ctx_positions, bonus, start, num_draft):
    """Logits [K, V] for the block [bonus, MASK x K] at positions start..start+K over all of `taps`."""
    heads, kv_heads, head_dim, theta = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                        cfg["head_dim"], cfg["rope_theta"])
    context = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])  # no input_layernorm on this path
    ids = torch.tensor([bonus] + [cfg["dflash_config"]["mask_token_id"]] * num_draft)
    positions = start + torch.arange(num_draft + 1)
    x = w["embed"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."

        def project(h, name, n, p=p):
            return (h @ w[f"{p}self_attn.{name}_proj.weight"].T).view(h.shape[0], n, head_dim)

        k_norm = w[f"{p}self_attn.k_norm.weight"]
        h = rms(x, w[f"{p}input_layernorm.weight"])
        q = rope(rms(project(h, "q", heads), w[f"{p}self_attn.q_norm.weight"]), positions, theta)
        keys = torch.cat([rope(rms(project(context, "k", kv_heads), k_norm), ctx_positions, theta),
                          rope(rms(project(h, "k", kv_heads), k_norm), positions, theta)])
        values = torch.cat([project(context, "v", kv_heads), project(h, "v", kv_heads)])
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                              is_causal=False, enable_gqa=True).transpose(0, 1)
        x = x + attn.reshape(x.shape[0], -1) @ w[f"{p}self_attn.o_proj.weight"].T
        h = rms(x, w[f"{p}post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[f"{p}mlp.gate_proj.weight"].T) * (h @ w[f"{p}mlp.up_proj.weight"].T)) \
            @ w[f"{p}mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])[1:] @ w["lm_head"].T


# ---- the serving path ---------------------------------------------------------------------------


def arena_views(num_blocks, layers, kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    shape = (num_blocks, layers, 2, TOKENS_PER_BLOCK, kv_heads, head_dim)
    arena = torch.zeros(shape, dtype=dtype, device=device)
    return arena, [(arena[:, i, 0], arena[:, i, 1]) for i in range(layers)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import json

    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dflash")
    target_dir = write_target_checkpoint(root / "target", "qwen3", seed=3)
    drafter_dir = write_drafter_checkpoint(root / "drafter", target_dir, num_layers=2, block_size=8,
                                           target_layer_ids=TAPS, seed=4)
    target, checkpoint = load_target(target_dir, tap_layer_ids=TAPS, dtype="float32", progress=False)
    drafter = load_drafter(drafter_dir, checkpoint.config, dtype="float32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    weights = {name: t.double() for name, t in load_file(str(drafter_dir / "model.safetensors")).items()}
    target_weights = load_file(str(target_dir / "model.safetensors"))
    weights["embed"] = target_weights["model.embed_tokens.weight"].double()
    weights["lm_head"] = target_weights["lm_head.weight"].double()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(5)
    streams = [torch.randint(0, 159, (40,), generator=gen).tolist() for _ in range(2)]
    with torch.no_grad():
        hidden = [hf(torch.tensor([s]), output_hidden_states=True).hidden_states for s in streams]
    return dict(target=target, drafter=drafter, weights=weights, cfg=cfg, streams=streams, hidden=hidden)


def run_serving_path(setup, device="cpu"):
    """Per step: target over the newly committed tokens -> project_context -> propose. Returns logits
    (on the CPU). On CUDA, copies of the models run every kernel of the serving path."""
    target, drafter, streams = setup["target"], setup["drafter"], setup["streams"]
    if device != "cpu":
        target, drafter = copy.deepcopy(target).to(device), copy.deepcopy(drafter).to(device)
    tcfg, dcfg = target.config, drafter.config
    _, target_caches = arena_views(12, tcfg.num_hidden_layers, tcfg.num_key_value_heads, tcfg.head_dim,
                                   device=device)
    draft_arena, draft_caches = arena_views(12, dcfg.num_hidden_layers, dcfg.num_key_value_heads,
                                            dcfg.head_dim, device=device)
    block_ids = list(range(12))
    random.Random(6).shuffle(block_ids)
    tables = [block_ids[:6], block_ids[6:]]  # one block table per sequence, shared by both groups
    done, logits = [0, 0], []
    for lengths, num_draft in zip(CONTEXT_LENGTHS, DRAFTS_PER_STEP):
        chunks = [SeqChunk(s[done[i] : lengths[i]], done[i], tables[i], num_logits=0,
                           num_taps=lengths[i] - done[i]) for i, s in enumerate(streams)]
        batch = pack(chunks, TOKENS_PER_BLOCK, device=device)
        taps = target(batch, target_caches).taps
        drafter.project_context(taps, batch.positions, batch.slot_mapping, draft_caches)
        before = draft_arena.clone()
        draft = drafter.propose(
            DraftBatch(bonus_tokens=torch.tensor([s[n] for s, n in zip(streams, lengths)], device=device),
                       start_positions=torch.tensor(lengths, device=device), block_table=batch.block_table,
                       ctx_lens=torch.tensor(lengths, dtype=torch.int32, device=device)),
            draft_caches, target.embed_weight, target.lm_head_weight, num_draft, return_logits=True,
        )
        assert torch.equal(draft_arena, before), "propose must never store the noise block's K/V"
        assert draft.tokens.shape == (2, num_draft) and torch.equal(draft.tokens, draft.logits.argmax(-1))
        logits.append(draft.logits.cpu())
        done = list(lengths)
    return logits


def run_reference(setup, tap_shift=0, position_shift=0):
    """The dense oracle; tap_shift=-1 reads HF hidden_states[i] (a layer's input) instead of [i + 1]."""
    logits = []
    for lengths, num_draft in zip(CONTEXT_LENGTHS, DRAFTS_PER_STEP):
        step = []
        for stream, hidden, n in zip(setup["streams"], setup["hidden"], lengths):
            taps = torch.cat([hidden[i + 1 + tap_shift][0, :n] for i in TAPS], dim=-1).double()
            positions = torch.arange(n) + position_shift
            w, cfg = setup["weights"], setup["cfg"]
            step.append(dense_draft_logits(w, cfg, taps, positions, stream[n], n, num_draft))
        logits.append(torch.stack(step))
    return logits


@pytest.fixture(scope="module")
def served(setup):
    return run_serving_path(setup)


def max_error(ours, reference):
    return max((a.double() - b).abs().max().item() for a, b in zip(ours, reference))


def test_drafts_match_dense_dflash_over_context_growth(setup, served):
    reference = run_reference(setup)
    for ours, expected in zip(served, reference):
        torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(("tap_shift", "position_shift"), [(-1, 0), (1, 0), (0, 1), (0, -1)])
def test_the_comparison_catches_a_wrong_tap_or_an_off_by_one_context_position(setup, served, tap_shift,
                                                                              position_shift):
    assert max_error(served, run_reference(setup)) < 1e-4
    assert max_error(served, run_reference(setup, tap_shift, position_shift)) > 1e-2


@pytest.mark.gpu
def test_the_kernels_on_cuda_stay_far_closer_to_dense_dflash_than_a_wrong_tap_or_position(setup, served):
    """The serving path's kernels (fused q/k/v epilogues, deferred adds, paged attention over both groups):
    fp32 with TF32 dots in the target's attention, so a tolerance, set by the bugs it must tell apart."""
    reference = run_reference(setup)
    shifts = [(-1, 0), (1, 0), (0, 1), (0, -1)]  # a tap one layer off, a context position one off
    wrong = min(max_error(served, run_reference(setup, *shift)) for shift in shifts)
    assert max_error(run_serving_path(setup, "cuda"), reference) < wrong / 10


def test_context_keys_are_normed_and_rotated_at_their_own_positions(setup):
    """Read project_context's output from the pages: k = rope(k_norm(k_proj(c)), pos), v = v_proj(c)."""
    drafter, w, cfg = setup["drafter"], setup["weights"], setup["cfg"]
    gen = torch.Generator().manual_seed(7)
    taps = torch.randn(5, len(TAPS) * cfg["hidden_size"], generator=gen)
    positions = torch.tensor([3, 40, 41, 7, 100])
    slots = torch.tensor([2 * 16 + 3, 5 * 16 + 8, 5 * 16 + 9, -1, 0 * 16 + 4])
    arena, caches = arena_views(6, 2, cfg["num_key_value_heads"], cfg["head_dim"])
    drafter.project_context(taps, positions, slots, caches)
    context = rms(taps.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    written = 0
    for layer in range(2):
        p = f"layers.{layer}.self_attn."
        k = rms((context @ w[p + "k_proj.weight"].T).view(5, 2, 16), w[p + "k_norm.weight"])
        k = rope(k, positions, cfg["rope_theta"])
        v = (context @ w[p + "v_proj.weight"].T).view(5, 2, 16)
        for row, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, TOKENS_PER_BLOCK)
            torch.testing.assert_close(arena[block, layer, 0, offset].double(), k[row], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(arena[block, layer, 1, offset].double(), v[row], rtol=1e-5, atol=1e-5)
            written += 2
    assert (arena != 0).any(-1).any(-1).sum().item() == written  # slot -1 skipped, nothing else touched


def test_fp8_draft_pages_with_scales_stay_close_to_fp32(setup, served):
    """The same first step with e4m3 context pages and per-layer scales: drafts' logits stay near."""
    target, drafter, streams = setup["target"], setup["drafter"], setup["streams"]
    lengths = CONTEXT_LENGTHS[0]
    _, target_caches = arena_views(12, 4, 2, 16)
    _, fp8 = arena_views(12, 2, 2, 16, torch.float8_e4m3fn)
    caches = [(k, v, 0.05, 0.05) for k, v in fp8]
    chunks = [SeqChunk(s[:n], 0, [2 * i, 2 * i + 1, 2 * i + 6], num_logits=0, num_taps=n)
              for i, (s, n) in enumerate(zip(streams, lengths))]
    batch = pack(chunks, TOKENS_PER_BLOCK)
    drafter.project_context(target(batch, target_caches).taps, batch.positions, batch.slot_mapping, caches)
    draft = drafter.propose(
        DraftBatch(torch.tensor([s[n] for s, n in zip(streams, lengths)]), torch.tensor(lengths),
                   batch.block_table, torch.tensor(lengths, dtype=torch.int32)),
        caches, target.embed_weight, target.lm_head_weight, DRAFTS_PER_STEP[0], return_logits=True,
    )
    error = (draft.logits - served[0]).abs().max().item()
    assert 0 < error < 0.25


def _draft_batch(**changes):
    fields = dict(bonus_tokens=torch.tensor([4, 5]), start_positions=torch.tensor([3, 9]),
                  block_table=torch.tensor([[0], [1]], dtype=torch.int32),
                  ctx_lens=torch.tensor([3, 9], dtype=torch.int32))
    return DraftBatch(**{**fields, **changes})


@pytest.mark.parametrize(("changes", "message"), [
    ({"ctx_lens": torch.tensor([3, 9])}, "ctx_lens must be a 1-d int32 tensor"),
    ({"start_positions": torch.tensor([3])}, "start_positions has 1 rows, bonus_tokens has 2"),
    ({"block_table": torch.tensor([0, 1], dtype=torch.int32)}, "block_table must be a 2-d int32"),
    ({"bonus_tokens": [4, 5]}, "bonus_tokens must be a torch.Tensor"),
])
def test_draft_batch_names_the_bad_field(changes, message):
    assert _draft_batch().num_seqs == 2
    with pytest.raises((ValueError, TypeError), match=message):
        _draft_batch(**changes)


def test_bad_propose_and_project_context_inputs_are_named(setup):
    target, drafter = setup["target"], setup["drafter"]
    _, caches = arena_views(2, 2, 2, 16)
    embed, head = target.embed_weight, target.lm_head_weight
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in 1..7 \(block_size - 1\), got 8"):
        drafter.propose(_draft_batch(), caches, embed, head, 8)
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in 1\.\.7"):
        drafter.propose(_draft_batch(), caches, embed, head, 0)
    with pytest.raises(ValueError, match=r"embed must be \[V, 64\]"):
        drafter.propose(_draft_batch(), caches, embed[:, :32], head, 3)
    with pytest.raises(ValueError, match="kv_caches has 1 entries, the model has 2 layers"):
        drafter.propose(_draft_batch(), caches[:1], embed, head, 3)
    taps = torch.zeros(3, 128)
    with pytest.raises(ValueError, match=r"taps must be \[N, 128\] \(n_taps \* hidden_size\), got \(3, 64\)"):
        drafter.project_context(taps[:, :64], torch.arange(3), torch.arange(3), caches)
    with pytest.raises(ValueError, match="positions must be 1-d with 3 rows"):
        drafter.project_context(taps, torch.arange(2), torch.arange(3), caches)

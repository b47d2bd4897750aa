"""The paged target against HF transformers' Qwen3ForCausalLM / LlamaForCausalLM on the same checkpoint.

Each step runs through our pages (random, non-contiguous block ids, pages of 16 tokens); the oracle
is HF's plain forward over the whole sequence so far, with no cache at all.
"""

import copy
import os
import random

import pytest
import torch

from target_service.runner.checkpoint import load_target
from target_service.runner.forward_batch import ForwardBatch, SeqChunk, pack
from tests.tiny_checkpoints import LLAMA3_ROPE, write_target_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub

TOKENS_PER_BLOCK = 16
TAPS = (0, 2, 3)  # includes the last layer, whose HF hidden state is the final-normed one
VARIANTS = {
    "qwen3-untied": ("qwen3", False, {}),
    "qwen3-tied-bias": ("qwen3", True, {"attention_bias": True}),
    "llama-untied-llama3rope": ("llama", False, {"rope_scaling": LLAMA3_ROPE}),
    "llama-tied": ("llama", True, {"num_key_value_heads": 4}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, tied, extra = VARIANTS[request.param]
    directory = write_target_checkpoint(tmp_path_factory.mktemp(request.param), arch, tied=tied,
                                        seed=len(request.param), **extra)
    ours, _ = load_target(directory, tap_layer_ids=TAPS, dtype="float32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return ours, hf


class Pages:
    """A target arena [num_blocks, L, 2, tokens_per_block, NKV, D] and shuffled block ids per sequence."""

    def __init__(self, config, num_blocks=24, seed=0, device="cpu"):
        shape = (num_blocks, config.num_hidden_layers, 2, TOKENS_PER_BLOCK, config.num_key_value_heads,
                 config.head_dim)
        self.arena = torch.zeros(shape, device=device)
        self.caches = [(self.arena[:, i, 0], self.arena[:, i, 1]) for i in range(config.num_hidden_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}

    def block_table(self, seq: int, length: int) -> list[int]:
        blocks = self.blocks.setdefault(seq, [])
        while len(blocks) * TOKENS_PER_BLOCK < length:
            blocks.append(self.free.pop())
        return blocks


def hf_forward(hf, tokens):
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return out.logits[0], [state[0] for state in out.hidden_states]


def assert_close(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def random_tokens(gen, count, vocab=160):
    return torch.randint(0, vocab, (count,), generator=gen).tolist()


def test_prefill_logits_and_taps_match_transformers(models):
    ours, hf = models
    gen = torch.Generator().manual_seed(10)
    pages = Pages(ours.config)
    prompts = [random_tokens(gen, n) for n in (20, 37, 5)]
    chunks = [SeqChunk(p, 0, pages.block_table(s, len(p)), num_logits=len(p), num_taps=len(p))
              for s, p in enumerate(prompts)]
    out = ours(pack(chunks, TOKENS_PER_BLOCK), pages.caches)
    row = 0
    for prompt in prompts:
        logits, hidden = hf_forward(hf, prompt)
        rows = slice(row, row + len(prompt))
        assert_close(out.logits[rows], logits)
        # taps[i] = output of decoder layer TAPS[i] = HF hidden_states[TAPS[i] + 1]
        assert_close(out.taps[rows], torch.cat([hidden[i + 1] for i in TAPS], dim=-1))
        row += len(prompt)


def test_decode_token_by_token_through_pages_matches_transformers(models):
    ours, hf = models
    gen = torch.Generator().manual_seed(11)
    pages = Pages(ours.config, seed=1)
    seqs = [random_tokens(gen, n) for n in (17, 30)]  # decodes cross the 32-token page boundary
    chunks = [SeqChunk(s, 0, pages.block_table(i, len(s))) for i, s in enumerate(seqs)]
    ours(pack(chunks, TOKENS_PER_BLOCK), pages.caches)
    for _ in range(4):
        chunks = []
        for i, seq in enumerate(seqs):
            seq.append(random_tokens(gen, 1)[0])
            chunks.append(SeqChunk(seq[-1:], len(seq) - 1, pages.block_table(i, len(seq))))
        out = ours(pack(chunks, TOKENS_PER_BLOCK), pages.caches)
        for i, seq in enumerate(seqs):
            assert_close(out.logits[i], hf_forward(hf, seq)[0][-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: the kernels
def test_mixed_batch_of_prefill_chunk_verify_block_and_decode_matches_transformers(models, device):
    ours, hf = models
    if device == "cuda":  # every layer's kernels: the q/k/v epilogue, the deferred adds, paged attention
        ours = copy.deepcopy(ours).to(device)  # a copy: the fixture's model serves the CPU tests too
    gen = torch.Generator().manual_seed(12)
    pages = Pages(ours.config, seed=2, device=device)
    chunked, verified, decoded = random_tokens(gen, 35), random_tokens(gen, 25), random_tokens(gen, 9)
    first = [SeqChunk(chunked[:20], 0, pages.block_table(0, 20), num_logits=0),
             SeqChunk(verified, 0, pages.block_table(1, 25)), SeqChunk(decoded, 0, pages.block_table(2, 9))]
    ours(pack(first, TOKENS_PER_BLOCK, device=device), pages.caches)
    block = random_tokens(gen, 5)  # [bonus, d1..d4] at positions 25..29
    step = [SeqChunk(chunked[20:], 20, pages.block_table(0, 35), num_taps=15),
            SeqChunk(block, 25, pages.block_table(1, 30), num_logits=5, num_taps=5),
            SeqChunk([7], 9, pages.block_table(2, 10))]
    batch = pack(step, TOKENS_PER_BLOCK, device=device)
    assert batch.logits_indices.tolist() == [14, 15, 16, 17, 18, 19, 20]
    out = ours(batch, pages.caches)
    out = type(out)(out.logits.cpu(), out.taps.cpu())
    # fp32 on CUDA: paged attention's dots take TF32 operands (~1e-3), far below a misplaced add or tap
    tolerance = dict(rtol=1e-5, atol=2e-5) if device == "cpu" else dict(rtol=1e-2, atol=1e-2)
    chunk_logits, chunk_hidden = hf_forward(hf, chunked)
    torch.testing.assert_close(out.logits[0], chunk_logits[-1], **tolerance)
    torch.testing.assert_close(out.taps[:15], torch.cat([chunk_hidden[i + 1][20:] for i in TAPS], dim=-1),
                               **tolerance)
    torch.testing.assert_close(out.logits[1:6], hf_forward(hf, verified + block)[0][25:], **tolerance)
    torch.testing.assert_close(out.logits[6], hf_forward(hf, [*decoded, 7])[0][-1], **tolerance)


def test_embeddings_and_lm_head_are_exposed_and_tied_when_the_checkpoint_ties_them(models):
    ours, hf = models
    assert torch.equal(ours.embed_weight, hf.get_input_embeddings().weight)
    assert torch.equal(ours.lm_head_weight, hf.get_output_embeddings().weight)
    assert (ours.lm_head_weight is ours.embed_weight) == ours.config.tie_word_embeddings


def test_forward_rejects_caches_for_the_wrong_number_of_layers(models):
    ours, _ = models
    pages = Pages(ours.config)
    batch = pack([SeqChunk([1, 2], 0, pages.block_table(0, 2))], TOKENS_PER_BLOCK)
    with pytest.raises(ValueError, match="kv_caches has 3 entries, the model has 4 layers"):
        ours(batch, pages.caches[:3])


def test_tap_layer_ids_outside_the_target_are_rejected(tmp_path):
    directory = write_target_checkpoint(tmp_path, "qwen3")
    with pytest.raises(ValueError, match=r"tap_layer_ids \[4\] are outside the target's layers 0..3"):
        load_target(directory, tap_layer_ids=[1, 4], dtype="float32", progress=False)


def _batch(**changes):
    fields = dict(
        input_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 1, 0]),
        slot_mapping=torch.tensor([32, 33, 16]), block_table=torch.tensor([[2], [1]], dtype=torch.int32),
        seq_lens=torch.tensor([2, 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        logits_indices=torch.tensor([1, 2]), tap_indices=torch.tensor([], dtype=torch.int64),
    )
    fields.update(changes)
    return ForwardBatch(**fields)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"positions": torch.tensor([0, 1])}, "positions has 2 rows, input_ids has 3"),
        ({"seq_lens": torch.tensor([2, 1])}, "seq_lens must be a 1-d int32 tensor"),
        ({"block_table": torch.tensor([2, 1], dtype=torch.int32)}, "block_table must be a 2-d int32"),
        ({"input_ids": torch.tensor([5.0, 6.0, 7.0])}, "input_ids must be a 1-d int32/int64"),
        ({"query_start_loc": torch.tensor([0, 3], dtype=torch.int32)}, "query_start_loc 2 entries"),
        ({"logits_indices": [1, 2]}, "logits_indices must be a torch.Tensor"),
    ],
)
def test_forward_batch_names_the_bad_field(changes, message):
    assert _batch().num_seqs == 2
    with pytest.raises((ValueError, TypeError), match=message):
        _batch(**changes)


def test_pack_lays_out_slots_positions_and_rows():
    batch = pack([SeqChunk([9, 8, 7], 15, [4, 2], num_logits=3, num_taps=2), SeqChunk([3], 0, [5])], 16)
    assert batch.positions.tolist() == [15, 16, 17, 0]
    assert batch.slot_mapping.tolist() == [4 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1, 5 * 16]
    assert batch.seq_lens.tolist() == [18, 1] and batch.query_start_loc.tolist() == [0, 3, 4]
    assert batch.block_table.tolist() == [[4, 2], [5, 0]]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3] and batch.tap_indices.tolist() == [1, 2]
    with pytest.raises(ValueError, match="block_table has 1 blocks; positions up to 17 need 2"):
        pack([SeqChunk([9, 8, 7], 15, [4])], 16)
    with pytest.raises(ValueError, match=r"num_logits must be in 0..1, got 2"):
        SeqChunk([1], 0, [0], num_logits=2)

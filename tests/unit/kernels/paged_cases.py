"""Shared cases of the paged attention tests: random paged batches and the float64 oracle they meet.

Every batch draws fresh random queries and pages, shuffles the block tables and ends lengths
mid-page; `run_kernel` poisons the output with NaN first, so an unwritten or misplaced row cannot
pass `assert_close`.
"""

from __future__ import annotations

import torch

import kernels

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# relative L2 error bounds; compiled fp32 runs its dots in tf32, the interpreter in true fp32
TOL = {torch.float32: 5e-3 if CUDA else 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def attention_f64(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=None,
                  k_scale=1.0, v_scale=1.0):
    """Causal attention of each sequence's queries over its de-paged keys, in float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    tokens_per_block = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = block_table[b].long()[pos // tokens_per_block]
        keys = k_cache[pages, pos % tokens_per_block].double() * float(k_scale)  # [n, NKV, D]
        values = v_cache[pages, pos % tokens_per_block].double() * float(v_scale)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), keys) * scale
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def make_batch(q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=32, tokens_per_block=16,
               dtype=torch.float32, device=DEVICE):
    """Random queries and pages for sequences of q_lens new queries after ctx_lens cached keys."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    pages = [-(-n // tokens_per_block) for n in seq_lens]
    num_blocks = sum(pages) + 3  # a few pages no sequence owns
    ids = torch.randperm(num_blocks, device=device).int()
    table = torch.full((len(q_lens), max(pages) + 1), -1, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[used:used + n]
        used += n
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
    return dict(
        q=torch.randn(int(starts[-1]), num_heads, head_dim, device=device).to(dtype),
        k_cache=torch.randn(shape, device=device).to(dtype),
        v_cache=torch.randn(shape, device=device).to(dtype),
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts,
    )


def run_kernel(batch, **kwargs):
    out = torch.full_like(batch["q"], float("nan"))
    result = kernels.paged_attention(**batch, out=out, backend="triton", **kwargs)
    assert result is out
    return out


def assert_close(out, expected, dtype):
    assert not out.isnan().any(), "some output rows were never written"
    err = (out.double() - expected).norm() / expected.norm()
    assert err < TOL[dtype], f"relative error {err:.2e} above {TOL[dtype]:.0e}"

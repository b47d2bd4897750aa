"""Reference target attention: causal over each sequence's pages, packed varlen queries."""

from __future__ import annotations

import torch

from kernels.reference.paging import gather_pages


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
    *, scale=None, k_scale=None, v_scale=None, num_splits=None, out=None,
) -> torch.Tensor:
    """q [T, NH, D]; query i of sequence b sits at seq_lens[b] - q_len_b + i, sees keys <= it.

    `num_splits` is accepted for signature parity and has no effect here.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    result = torch.empty_like(q) if out is None else out
    for b, seq_len in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        keys = gather_pages(k_cache, block_table[b], seq_len, k_scale).repeat_interleave(group, dim=1)
        values = gather_pages(v_cache, block_table[b], seq_len, v_scale).repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys) * scale
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        result[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(result.dtype)
    return result

"""Reference DFlash draft cross-attention: paged context plus the dense noise block, no mask."""

from __future__ import annotations

import torch

from kernels.reference.paging import gather_pages


def paged_context_attention(
    q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise,
    *, scale=None, k_scale=None, v_scale=None, num_splits=None, out=None,
) -> torch.Tensor:
    """q [B, Q, NH, D] attends over ctx_lens[b] paged keys plus all Q noise keys; one softmax.

    `num_splits` is accepted for signature parity and has no effect here.
    """
    batch, _, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    lens = ctx_lens.tolist()
    result = torch.empty_like(q) if out is None else out
    for b in range(batch):
        ctx_k = gather_pages(k_cache, block_table[b], lens[b], k_scale)
        ctx_v = gather_pages(v_cache, block_table[b], lens[b], v_scale)
        keys = torch.cat([ctx_k, k_noise[b].float()]).repeat_interleave(group, dim=1)
        values = torch.cat([ctx_v, v_noise[b].float()]).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys) * scale
        probs = scores.softmax(dim=-1)
        result[b] = torch.einsum("hqk,khd->qhd", probs, values).to(result.dtype)
    return result

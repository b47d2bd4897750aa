"""Reference scatter of K/V rows into pages."""

from __future__ import annotations

import torch

from kernels.reference.paging import scale_value

PAD_SLOT = -1


def _quantize(rows: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    if cache_dtype == torch.float8_e4m3fn:
        limit = torch.finfo(torch.float8_e4m3fn).max
        return (rows.float() / scale_value(scale)).clamp(-limit, limit).to(cache_dtype)
    return rows.to(cache_dtype)


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Write rows k, v [N, NKV, D] at slots (block * tokens_per_block + offset); slot -1 skips."""
    keep = slot_mapping != PAD_SLOT
    slots = slot_mapping[keep].long()
    tokens_per_block = k_cache.shape[1]
    blocks, offsets = slots // tokens_per_block, slots % tokens_per_block
    k_cache[blocks, offsets] = _quantize(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = _quantize(v[keep], v_cache.dtype, v_scale)

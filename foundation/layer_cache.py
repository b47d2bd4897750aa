"""LayerCache: one layer's paged K/V views, the one type the pool hands out and the models read.

The pool memory (`kvpool_service.memory`) carves its arenas into these; the target and the draft
model check them against their geometry (`as_layer_caches`) and pass the fields to the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LayerCache(NamedTuple):
    """One layer's K and V page views, plus fp8 scales (None when the cache is not fp8).

    k_cache, v_cache: [num_blocks, tokens_per_block, NKV, D], any strides (views into a pool arena).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float | torch.Tensor | None = None
    v_scale: float | torch.Tensor | None = None


def as_layer_caches(kv_caches, num_layers: int, num_kv_heads: int, head_dim: int) -> list[LayerCache]:
    """Check a per-layer list of (k_cache, v_cache[, k_scale, v_scale]) and return LayerCache entries."""
    if len(kv_caches) != num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} entries, the model has {num_layers} layers")
    caches = [entry if isinstance(entry, LayerCache) else LayerCache(*entry) for entry in kv_caches]
    for index, cache in enumerate(caches):
        for name in ("k_cache", "v_cache"):
            view = getattr(cache, name)
            if view.dim() != 4 or tuple(view.shape[2:]) != (num_kv_heads, head_dim):
                raise ValueError(
                    f"kv_caches[{index}].{name} has shape {tuple(view.shape)}; expected "
                    f"[num_blocks, tokens_per_block, {num_kv_heads}, {head_dim}]"
                )
    return caches

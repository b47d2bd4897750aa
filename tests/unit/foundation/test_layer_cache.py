import math

import pytest
import torch

from foundation.layer_cache import as_layer_caches


def test_layer_caches_are_checked_against_the_model_geometry():
    arena = torch.zeros(3, 2, 2, 16, 2, 16)  # [blocks, layers, K/V, tokens_per_block, heads, D]
    views = [(arena[:, i, 0], arena[:, i, 1]) for i in range(2)]
    caches = as_layer_caches(views, num_layers=2, num_kv_heads=2, head_dim=16)
    assert caches[1].k_cache.data_ptr() == arena[:, 1, 0].data_ptr() and caches[1].k_scale is None
    with pytest.raises(ValueError, match="kv_caches has 2 entries, the model has 3 layers"):
        as_layer_caches(views, num_layers=3, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"kv_caches\[0\]\.k_cache has shape \(3, 16, 2, 16\)"):
        as_layer_caches(views, num_layers=2, num_kv_heads=4, head_dim=16)
    assert math.isclose(as_layer_caches([(*views[0], 0.5, 2.0)], 1, 2, 16)[0].v_scale, 2.0)

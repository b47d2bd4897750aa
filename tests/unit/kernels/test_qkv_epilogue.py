"""norm_rope_store (one launch: q/k norm + RoPE, k/v into the pages) against the reference composition,
norm_rope then store_kv in torch (Triton's interpreter on CPU)."""

import pytest
import torch

from kernels import PAD_SLOT
from kernels.layers import RotaryEmbedding
from kernels.qkv_epilogue import norm_rope_store

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _case(generator, tokens, q_heads, kv_heads, head_dim, tokens_per_block, dtype=torch.float32):
    """A fused projection's q/k/v views, norm weights, RoPE tables, a cache with random old contents and
    distinct random slots (some PAD_SLOT)."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    views = [t.reshape(tokens, -1, head_dim) for t in (q, k, v)]
    num_blocks = -(-tokens // tokens_per_block) + 2
    slots = torch.randperm(num_blocks * tokens_per_block, generator=generator)[:tokens]
    slots[torch.rand(tokens, generator=generator) < 0.25] = PAD_SLOT
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    cos, sin = RotaryEmbedding(head_dim, 10000.0).cos_sin(positions.to(DEVICE))
    cache_shape = (num_blocks, tokens_per_block, kv_heads, head_dim)
    return views, randn(head_dim), randn(head_dim), cos, sin, randn(*cache_shape), randn(*cache_shape), \
        slots.to(DEVICE)


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,tokens_per_block",
                         [(7, 4, 2, 16, 16), (40, 11, 3, 32, 16), (3, 2, 2, 64, 32), (1, 1, 1, 16, 16)])
def test_matches_norm_rope_then_store(with_q, with_norm, tokens, q_heads, kv_heads, head_dim,
                                      tokens_per_block):
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    (q, k, v), q_w, k_w, cos, sin, k_cache, v_cache, slots = _case(
        generator, tokens, q_heads, kv_heads, head_dim, tokens_per_block)
    q_w, k_w = (q_w, k_w) if with_norm else (None, None)
    q = q if with_q else None
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = norm_rope_store(q, k, v, q_w, k_w, cos, sin, 1e-6, expected_k, expected_v, slots,
                                 backend="torch")
    got_q = norm_rope_store(q, k, v, q_w, k_w, cos, sin, 1e-6, k_cache, v_cache, slots, backend="triton")
    if with_q:
        torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-6)
    else:
        assert got_q is None and expected_q is None
    # stored rows match; rows of PAD_SLOT tokens and every other slot keep their old contents
    torch.testing.assert_close(k_cache, expected_k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)


def test_the_reference_is_norm_rope_then_store_by_hand():
    """The torch path by hand: RMSNorm per head, the NeoX rotation, then the rows at their slots."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    (q, k, v), q_w, k_w, cos, sin, k_cache, v_cache, slots = _case(generator, 20, 4, 2, 16, 16)
    old_k = k_cache.clone()

    def by_hand(x, w):
        x64 = x.double()
        normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        x1, x2 = normed.chunk(2, dim=-1)
        c, s = cos.double()[:, None, :8], sin.double()[:, None, :8]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    got_q = norm_rope_store(q, k, v, q_w, k_w, cos, sin, 1e-6, k_cache, v_cache, slots, backend="torch")
    torch.testing.assert_close(got_q.double(), by_hand(q, q_w), rtol=1e-5, atol=1e-5)
    want_k = by_hand(k, k_w)
    for t, slot in enumerate(slots.tolist()):
        if slot == PAD_SLOT:
            continue
        torch.testing.assert_close(k_cache[slot // 16, slot % 16].double(), want_k[t], rtol=1e-5, atol=1e-5)
        assert torch.equal(v_cache[slot // 16, slot % 16], v[t])
    untouched = torch.ones(old_k.shape[:2], dtype=torch.bool)
    for slot in slots[slots != PAD_SLOT].tolist():
        untouched[slot // 16, slot % 16] = False
    assert torch.equal(k_cache[untouched], old_k[untouched])


def test_bad_shapes_are_named():
    generator = torch.Generator().manual_seed(0)
    (q, k, v), q_w, k_w, cos, sin, k_cache, v_cache, slots = _case(generator, 4, 2, 2, 16, 16)
    with pytest.raises(ValueError, match=r"q must be \[4, NH, 16\]"):
        norm_rope_store(q[:3], k, v, q_w, k_w, cos, sin, 1e-6, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"k_norm must be \[16\], got \(8,\)"):
        norm_rope_store(q, k, v, q_w, k_w[:8], cos, sin, 1e-6, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"cos and sin must be fp32 \[4, 16\]"):
        norm_rope_store(q, k, v, q_w, k_w, cos[:3], sin[:3], 1e-6, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        norm_rope_store(q, k, v, q_w, k_w, cos, sin, 1e-6, k_cache, v_cache, slots[:3])


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_bf16_on_the_gpu_equals_the_unfused_kernels(cache_dtype):
    """On the GPU the fused launch rounds where norm_rope and store_kv round: the same bits."""
    from kernels import store_kv
    from kernels.fused_layers import norm_rope

    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    (q, k, v), q_w, k_w, cos, sin, k_cache, v_cache, slots = _case(
        generator, 33, 32, 8, 128, 16, dtype=torch.bfloat16)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    k_scale = v_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = torch.tensor(0.37, device=DEVICE), 1.7
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q = norm_rope(q, q_w, cos, sin, 1e-6)
    store_kv(norm_rope(k, k_w, cos, sin, 1e-6), v, want_k, want_v, slots, k_scale=k_scale, v_scale=v_scale)
    got_q = norm_rope_store(q, k, v, q_w, k_w, cos, sin, 1e-6, k_cache, v_cache, slots,
                            k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(got_q, want_q)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))

"""RMSNorm, RoPE (incl. rope_scaling) and SwiGLU against float64 formulas and HF's frequency code."""


import pytest
import torch

from kernels.layers import RotaryEmbedding, apply_rope, rms_norm, rope_frequencies, swiglu


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_float64_formula(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen, dtype=torch.float64) * 3
    weight = 1 + 0.3 * torch.randn(64, generator=gen, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    got = rms_norm(x.to(dtype), weight.to(dtype), 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_rope_is_a_complex_rotation_of_the_two_halves():
    """NeoX pairing: (x_i, x_{i+D/2}) rotates by pos * theta^(-2i/D); checked with complex float64 math."""
    gen = torch.Generator().manual_seed(1)
    head_dim, theta = 32, 10000.0
    positions = torch.randint(0, 200, (9,), generator=gen)
    x = torch.randn(9, 3, head_dim, generator=gen)
    rope = RotaryEmbedding(head_dim, theta)
    cos, sin = rope.cos_sin(positions)
    got = apply_rope(x, cos, sin)

    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    phase = torch.exp(1j * positions.double()[:, None, None] * freqs)  # [T, 1, D/2]
    z = torch.complex(x[..., : head_dim // 2].double(), x[..., head_dim // 2 :].double()) * phase
    expected = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_rope_broadcasts_one_row_per_token_over_extra_axes():
    """cos/sin [B, Q, D] rotate q [B, Q, heads, D]; cos/sin [N, 1, D] rotate k [N, L, heads, D]."""
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(16, 500.0)
    positions = torch.randint(0, 50, (2, 5), generator=gen)
    q = torch.randn(2, 5, 4, 16, generator=gen)
    cos, sin = rope.cos_sin(positions)
    flat_cos, flat_sin = rope.cos_sin(positions.reshape(-1))
    expected = apply_rope(q.reshape(10, 4, 16), flat_cos, flat_sin).reshape(2, 5, 4, 16)
    torch.testing.assert_close(apply_rope(q, cos, sin), expected)


SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                         "truncate": False},
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_scaling_frequencies_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    theta, head_dim, max_position = 50000.0, 32, 512
    hf_config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                            rope_scaling=dict(scaling), max_position_embeddings=max_position)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    inv_freq, factor = rope_frequencies(head_dim, theta, scaling, max_position)
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_llama3_keeps_short_wavelengths_and_slows_long_ones():
    head_dim, theta = 32, 50000.0
    base, _ = rope_frequencies(head_dim, theta)
    scaled, factor = rope_frequencies(head_dim, theta, SCALINGS["llama3"], 512)
    assert factor == 1.0
    assert scaled[0] == base[0]  # wavelength 2*pi < 64 / 4: untouched
    assert scaled[-1] == pytest.approx(base[-1].item() / 8.0, rel=1e-6)  # wavelength > 64: divided by factor


def test_linear_scaling_divides_every_frequency():
    base, _ = rope_frequencies(16, 10000.0)
    scaled, _ = rope_frequencies(16, 10000.0, {"type": "linear", "factor": 2.5})  # the older "type" key
    torch.testing.assert_close(scaled, base / 2.5)


@pytest.mark.parametrize(
    ("scaling", "field"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type"),
        ({"rope_type": "linear"}, "rope_scaling.factor"),
        ({"rope_type": "linear", "factor": -1.0}, "rope_scaling.factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "rope_scaling.low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
         "high_freq_factor"),
        ({"rope_type": "yarn", "factor": "big"}, "rope_scaling.factor"),
    ],
)
def test_bad_rope_scaling_names_the_field(scaling, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        rope_frequencies(16, 10000.0, scaling, 512)


def test_swiglu_matches_separate_gate_and_up_projections():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    shapes = ((6, 8), (6, 8), (8, 6))
    gate, up, down = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes)
    g = x @ gate.T
    expected = (g / (1 + torch.exp(-g)) * (x @ up.T)) @ down.T
    torch.testing.assert_close(swiglu(x, torch.cat([gate, up]), down), expected)

"""The small layers the target and the drafter share: RMSNorm, rotary embeddings, SwiGLU.

Plain torch, no parameters of their own (the models own the weights). Numerics follow the HF
Qwen3 / Llama modules the checkpoints were trained with: RMSNorm normalises in fp32 and scales in
the input dtype; cos/sin are computed in fp32 from the inverse frequencies of `rope_scaling`.
Rotations are NeoX style (the two halves of a head form the complex pairs): a silent mismatch
here would only show up as bad outputs, so the tests pin it against an independent formula.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] / rms over the last dim (in fp32), cast back, then times weight [N] (HF's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); gate_up_weight [2I, H] stacks gate over up so one GEMM serves both."""
    gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight)


def _scaling_field(scaling: dict[str, Any], key: str, default: Any = None) -> float:
    value = scaling.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"rope_scaling.{key} must be a positive number, got {value!r}")
    return float(value)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], max_position: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a linear blend in between."""
    factor = _scaling_field(scaling, "factor")
    low = _scaling_field(scaling, "low_freq_factor")
    high = _scaling_field(scaling, "high_freq_factor")
    if high <= low:
        raise ValueError(f"rope_scaling.high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    context = _scaling_field(scaling, "original_max_position_embeddings", max_position)
    wavelen = 2 * math.pi / inv_freq
    # blend = 0 for wavelen >= context / low (fully scaled), 1 for wavelen <= context / high (kept)
    blend = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin by mscale."""
    context = _scaling_field(scaling, "original_max_position_embeddings", max_position)
    factor = _scaling_field(scaling, "factor", max_position / context)
    fast = _scaling_field(scaling, "beta_fast", 32)
    slow = _scaling_field(scaling, "beta_slow", 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is not None:
        attention_factor = _scaling_field(scaling, "attention_factor")
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    else:
        attention_factor = mscale(factor)

    def dim_of(rotations: float) -> float:
        # the rotary dim whose wavelength fits `rotations` turns into the original context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0.0, 1.0)
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolate = 1 - ramp  # 1 on the fast (high-frequency) dims
    inv_freq = (1.0 / (factor * base)) * ramp + (1.0 / base) * extrapolate
    return inv_freq, attention_factor


def rope_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None, max_position: int = 32768
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32) and the factor that scales cos/sin (1 except YaRN).

    rope_scaling is the checkpoint's dict (`rope_type` or the older `type`); None means plain RoPE.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    scaling = dict(rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling.rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, scaling, max_position)
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if kind == "linear":
        inv_freq = inv_freq / _scaling_field(scaling, "factor")
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position)
    return inv_freq, 1.0


class RotaryEmbedding:
    """cos/sin at arbitrary positions, computed on the fly (no table to size or keep in sync)."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling=None, max_position: int = 32768):
        self.head_dim = head_dim
        inv_freq, attention_factor = rope_frequencies(head_dim, rope_theta, rope_scaling, max_position)
        self.inv_freq, self.attention_factor = inv_freq, attention_factor
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        """inv_freq on `device`, copied there once: a copy per call would be a host-to-device copy in
        every step, which a CUDA graph cannot capture."""
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self.inv_freq.to(device)
        return self._inv_freq_on[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> cos, sin [..., head_dim] fp32 (the half-frequencies repeated twice)."""
        inv_freq = self._frequencies(positions.device)
        angles = positions.float()[..., None] * inv_freq  # [..., D/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., heads, D] by cos, sin [..., D] (one row per token, shared by all heads).

    NeoX pairing: element i and i + D/2 form one complex number, multiplied by e^{i * pos * f_i}.
    """
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)

"""A trainable Qwen3 causal LM, dense (no pages), whose parameter names ARE the HF checkpoint's.

`state_dict()` keys equal `target_weight_layout(config)`'s names, so saving is writing the state
dict and loading a trained target back is `load_state_dict`. The math is the serving model's
(kernels.layers: rms_norm, RoPE, SwiGLU), with SDPA over the whole causal sequence instead of pages.
Taps follow the serving semantics exactly (docs/architecture.md section 7): the output of decoder layer i,
final-normed when i is the last layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from foundation.checkpoint_config import TargetConfig
from kernels.layers import RotaryEmbedding, apply_rope, rms_norm, swiglu


class RMSNorm(nn.Module):
    """Holds the weight under the HF name `weight`; the math is kernels.layers.rms_norm."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(rows: int, cols: int) -> nn.Linear:
    layer = nn.Linear(cols, rows, bias=False)
    nn.init.normal_(layer.weight, std=0.02)
    return layer


class Attention(nn.Module):
    def __init__(self, config, *, qk_norm: bool = True):
        super().__init__()
        hidden, self.head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = _linear(self.num_heads * self.head_dim, hidden)
        self.k_proj = _linear(self.num_kv_heads * self.head_dim, hidden)
        self.v_proj = _linear(self.num_kv_heads * self.head_dim, hidden)
        self.o_proj = _linear(hidden, self.num_heads * self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def heads(self, x: torch.Tensor, proj: nn.Linear, count: int) -> torch.Tensor:
        return proj(x).unflatten(-1, (count, self.head_dim))  # [..., T, heads, D]

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, T, H] (input-normed) -> q [b, T, NH, D], k and v [b, T, NKV, D]; q, k normed and rotated.

        The one projection both the training forward and KV-cached generation (`dense_generate`) use."""
        q = apply_rope(self.q_norm(self.heads(x, self.q_proj, self.num_heads)), cos, sin)
        k = apply_rope(self.k_norm(self.heads(x, self.k_proj, self.num_kv_heads)), cos, sin)
        return q, k, self.heads(x, self.v_proj, self.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, T, H] (already input-normed) -> [b, T, H], causal."""
        q, k, v = self.qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = _linear(intermediate, hidden)
        self.up_proj = _linear(intermediate, hidden)
        self.down_proj = _linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DenseQwen3(nn.Module):
    """Qwen3ForCausalLM for training: `model.*` and `lm_head.weight`, exactly the HF names."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        if config.architecture != "Qwen3ForCausalLM" or config.attention_bias:
            raise ValueError("DenseQwen3 trains Qwen3ForCausalLM without attention biases; got "
                             f"{config.architecture} with attention_bias={config.attention_bias}")
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)
        self.model = Backbone(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _linear(config.vocab_size, config.hidden_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, input_ids: torch.Tensor, tap_layer_ids: Sequence[int] = ()
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [b, T] -> (final-normed hidden [b, T, H], taps [b, T, n_taps * H] or None)."""
        bad = [i for i in tap_layer_ids if not 0 <= i < len(self.model.layers)]
        if bad:
            raise ValueError(f"tap layer ids {bad} are outside 0..{len(self.model.layers) - 1}")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions)  # [T, D], broadcast over batch and heads
        h = self.model.embed_tokens(input_ids)
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin)
            if i in tap_layer_ids:
                tapped[i] = h
        out = self.model.norm(h)
        last = len(self.model.layers) - 1
        if last in tapped:  # the serving target final-norms a tap on its last layer (as HF does)
            tapped[last] = out
        taps = torch.cat([tapped[i] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
        return out, taps

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, T, V] (in the compute dtype; the loss upcasts)."""
        out, _ = self.hidden(input_ids)
        return F.linear(out, self.lm_head_weight)


def causal_lm_loss(model: DenseQwen3, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over [b, T] windows (every position predicts the next)."""
    logits = model(input_ids[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), input_ids[:, 1:].flatten())

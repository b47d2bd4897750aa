"""The DFlash drafter's training forward, dense, with the DFlash checkpoint's parameter names.

`state_dict()` keys equal `drafter_weight_layout(config)`'s names (`fc.weight`, `hidden_norm.weight`,
`layers.{i}.self_attn.q_proj.weight`, ..., `norm.weight`), so saving is writing the state dict.
The math is the serving drafter's (drafter_service.model), step for step:
  context  c = hidden_norm(fc(taps))                    [b, S, H], shared by every layer
  per layer, context K/V  k = rope(k_norm(k_proj(c)), 0..S-1), v = v_proj(c)   (no input_layernorm)
  per layer, noise        h = input_layernorm(x); q, k, v from h with q_norm / k_norm and RoPE at
                          the block's positions; each block's queries attend to [context | own
                          block] under `anchors.Blocks.mask`
  out      norm(x) at block positions 1..B-1, then the TARGET's lm_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foundation.checkpoint_config import DrafterConfig
from kernels.layers import RotaryEmbedding, apply_rope
from training.anchors import Blocks
from training.dense_target import MLP, Attention, RMSNorm, _linear


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, context, ctx_rope, noise_rope, mask) -> torch.Tensor:
        """x [b, n, B, H] noise stream; context [b, S, H]; mask [b, n, B, S + B] -> [b, n, B, H]."""
        attn = self.self_attn
        batch, blocks, block_size, _ = x.shape
        group = attn.num_heads // attn.num_kv_heads
        h = self.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.heads(h, attn.q_proj, attn.num_heads)), *noise_rope)
        k_noise = apply_rope(attn.k_norm(attn.heads(h, attn.k_proj, attn.num_kv_heads)), *noise_rope)
        v_noise = attn.heads(h, attn.v_proj, attn.num_kv_heads)
        k_ctx = apply_rope(attn.k_norm(attn.heads(context, attn.k_proj, attn.num_kv_heads)), *ctx_rope)
        v_ctx = attn.heads(context, attn.v_proj, attn.num_kv_heads)  # [b, S, NKV, D]

        def keys(ctx_part, noise_part):  # [b * n, NH, S + B, D]: the context repeated per block
            ctx_part = ctx_part[:, None].expand(batch, blocks, *ctx_part.shape[1:])
            both = torch.cat([ctx_part, noise_part], dim=2).flatten(0, 1).transpose(1, 2)
            return both.repeat_interleave(group, dim=1)

        out = F.scaled_dot_product_attention(
            q.flatten(0, 1).transpose(1, 2), keys(k_ctx, k_noise), keys(v_ctx, v_noise),
            attn_mask=mask.flatten(0, 1)[:, None],
        )  # [b * n, NH, B, D]
        out = out.transpose(1, 2).reshape(batch, blocks, block_size, -1)
        x = x + attn.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseDFlashDrafter(nn.Module):
    """Trainable DFlash drafter; the target's embeddings and lm_head are passed in, frozen."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)
        self.fc = _linear(hidden, len(config.target_layer_ids) * hidden)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, taps: torch.Tensor, blocks: Blocks, embed: torch.Tensor, lm_head: torch.Tensor
                ) -> torch.Tensor:
        """Logits [b, n, B-1, V] of block positions 1..B-1 for every block.

        taps [b, S, n_taps * H]: the frozen target's tapped hidden states of the whole sequence
        (teacher forcing); embed, lm_head [V, H]: the target's tables.
        """
        width = len(self.config.target_layer_ids) * self.config.hidden_size
        if taps.dim() != 3 or taps.shape[-1] != width:
            raise ValueError(f"taps must be [b, S, {width}] (n_taps * hidden_size), got {tuple(taps.shape)}")
        context = self.hidden_norm(self.fc(taps))
        ctx_positions = torch.arange(taps.shape[1], device=taps.device)
        ctx_rope = self.rotary.cos_sin(ctx_positions)  # [S, D]
        noise_rope = self.rotary.cos_sin(blocks.positions)  # [b, n, B, D]
        x = F.embedding(blocks.noise_ids, embed).to(context.dtype)
        for layer in self.layers:
            x = layer(x, context, ctx_rope, noise_rope, blocks.mask)
        return F.linear(self.norm(x[:, :, 1:]), lm_head.to(x.dtype))

"""The DFlash draft model: Qwen3-style layers whose cross-attention context lives in the pool's pages.

Two entry points (docs/architecture.md section 7):
- `project_context`, once per committed token: c = hidden_norm(fc(taps)); per draft layer
  k = rope(k_norm(k_proj(c)), pos), v = v_proj(c), written at the token's own slot. No
  input_layernorm on this path. All layers' k_proj and v_proj are one stacked weight, so the
  projection is ONE GEMM [N, H] x [H, L * 2 * NKV * D].
- `propose`, once per step: the noise block [bonus, MASK x K] at positions start..start+K,
  embedded with the TARGET's table, runs through the layers; each query attends to the stored
  context plus all K+1 noise keys with no mask; noise K/V is never stored. The target's lm_head
  at block positions 1..K, then argmax, gives K drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from drafter_service.draft_batch import DraftBatch
from foundation.checkpoint_config import ConfigError, DrafterConfig
from foundation.layer_cache import LayerCache, as_layer_caches
from foundation.weights import WeightSlot, empty_param
from kernels import paged_context_attention
from kernels.fused_layers import norm_rope, rms_norm, silu_and_mul
from kernels.layers import RotaryEmbedding
from kernels.linear import linear
from kernels.qkv_epilogue import norm_rope_store


class DraftOutput(NamedTuple):
    """tokens [B, K] int64 (argmax drafts); logits [B, K, V] fp32 when asked for, else None."""

    tokens: torch.Tensor
    logits: torch.Tensor | None


class DraftLayer(nn.Module):
    """One draft layer's own weights; its k/v projection and k_norm live stacked in the model."""

    def __init__(self, config: DrafterConfig, dtype: torch.dtype, device):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, head_dim,
        )
        self.eps = config.rms_norm_eps
        self.input_layernorm = empty_param([hidden], dtype, device)
        self.q_proj = empty_param([self.num_heads * head_dim, hidden], dtype, device)
        self.q_norm = empty_param([head_dim], dtype, device)
        self.o_proj = empty_param([hidden, self.num_heads * head_dim], dtype, device)
        self.post_attention_layernorm = empty_param([hidden], dtype, device)
        self.gate_up_proj = empty_param([2 * config.intermediate_size, hidden], dtype, device)
        self.down_proj = empty_param([hidden, config.intermediate_size], dtype, device)

    def forward(self, x, delta, kv_proj, k_norm, cos, sin, batch: DraftBatch, cache: LayerCache):
        """x + delta [B, Q, H] the noise residual stream (delta None: x alone); kv_proj [2 * NKV * D, H]
        (k rows over v rows); k_norm [D].

        As in the target's layers, the previous layer's last add is done by this layer's input norm
        and this layer's is left to the next: returns (x', the stream before this layer's MLP
        output; delta', that output).
        """
        batch_size, block_len = x.shape[:2]
        if delta is None:
            h = rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, x = rms_norm(delta, self.input_layernorm, self.eps, residual=x)
        q = linear(h, self.q_proj).view(batch_size, block_len, self.num_heads, self.head_dim)
        k, v = linear(h, kv_proj).view(batch_size, block_len, 2, self.num_kv_heads, self.head_dim).unbind(2)
        rows = batch_size * block_len  # per-head norm + RoPE, one fused kernel each on a GPU
        cos_rows, sin_rows = cos.reshape(rows, -1), sin.reshape(rows, -1)
        q = q.reshape(rows, self.num_heads, self.head_dim)
        q = norm_rope(q, self.q_norm, cos_rows, sin_rows, self.eps)
        k = norm_rope(k.reshape(rows, self.num_kv_heads, self.head_dim), k_norm, cos_rows, sin_rows, self.eps)
        q = q.view(batch_size, block_len, self.num_heads, -1)
        k = k.view(batch_size, block_len, self.num_kv_heads, -1)
        attn = paged_context_attention(
            q, cache.k_cache, cache.v_cache, batch.block_table, batch.ctx_lens, k, v,
            scale=self.head_dim**-0.5, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )
        attn_out = linear(attn.reshape(batch_size, block_len, -1), self.o_proj)
        mlp_in, x = rms_norm(attn_out, self.post_attention_layernorm, self.eps, residual=x)
        return x, linear(silu_and_mul(linear(mlp_in, self.gate_up_proj)), self.down_proj)


def drafter_weight_layout(config: DrafterConfig) -> dict[str, WeightSlot]:
    """DFlash tensor name -> where it lands in DFlashDrafter (k/v of all layers stacked in kv_proj)."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layout = {
        "fc.weight": WeightSlot("fc", 0, (hidden, len(config.target_layer_ids) * hidden)),
        "hidden_norm.weight": WeightSlot("hidden_norm", 0, (hidden,)),
        "norm.weight": WeightSlot("norm", 0, (hidden,)),
    }
    for i in range(config.num_hidden_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        # kv_proj rows: [k_0; v_0; k_1; v_1; ...], each block NKV * D rows
        for j, name in enumerate(("k_proj", "v_proj")):
            row = (2 * i + j) * kv_rows
            layout[f"{src}self_attn.{name}.weight"] = WeightSlot("kv_proj", row, (kv_rows, hidden))
        layout[f"{src}self_attn.k_norm.weight"] = WeightSlot("k_norm", i * head_dim, (head_dim,))
        layout[f"{src}self_attn.q_proj.weight"] = WeightSlot(dst + "q_proj", 0, (q_rows, hidden))
        layout[f"{src}self_attn.q_norm.weight"] = WeightSlot(dst + "q_norm", 0, (head_dim,))
        layout[f"{src}self_attn.o_proj.weight"] = WeightSlot(dst + "o_proj", 0, (hidden, q_rows))
        for name in ("input_layernorm", "post_attention_layernorm"):
            layout[f"{src}{name}.weight"] = WeightSlot(dst + name, 0, (hidden,))
        layout[f"{src}mlp.gate_proj.weight"] = WeightSlot(dst + "gate_up_proj", 0, (inter, hidden))
        layout[f"{src}mlp.up_proj.weight"] = WeightSlot(dst + "gate_up_proj", inter, (inter, hidden))
        layout[f"{src}mlp.down_proj.weight"] = WeightSlot(dst + "down_proj", 0, (hidden, inter))
    return layout


def _check_rows(name: str, tensor: torch.Tensor, dim: int, rows: int | None = None) -> None:
    if tensor.dim() != dim or (rows is not None and tensor.shape[0] != rows):
        expected = f"{dim}-d" + (f" with {rows} rows" if rows is not None else "")
        raise ValueError(f"{name} must be {expected}, got shape {tuple(tensor.shape)}")


class DFlashDrafter(nn.Module):
    """A DFlash drafter. Weights start uninitialised: `drafter_service.checkpoint.load_drafter` fills them."""

    def __init__(self, config: DrafterConfig, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if config.attention_bias:
            raise ConfigError("drafter attention_bias=True is not supported: DFlash layers have no biases")
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.kv_rows = config.num_key_value_heads * config.head_dim
        self.fc = empty_param([hidden, len(config.target_layer_ids) * hidden], dtype, device)
        self.hidden_norm = empty_param([hidden], dtype, device)
        self.kv_proj = empty_param([layers * 2 * self.kv_rows, hidden], dtype, device)
        self.k_norm = empty_param([layers * config.head_dim], dtype, device)
        self.layers = nn.ModuleList(DraftLayer(config, dtype, device) for _ in range(layers))
        self.norm = empty_param([hidden], dtype, device)

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def _caches(self, kv_caches) -> list[LayerCache]:
        config = self.config
        return as_layer_caches(kv_caches, config.num_hidden_layers, config.num_key_value_heads,
                               config.head_dim)

    @torch.inference_mode()
    def project_context(self, taps: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_caches: Sequence) -> None:
        """Write every draft layer's context K/V for N committed tokens into the draft pages.

        taps [N, n_taps * H]: the target's tapped hidden states of those tokens (TargetOutput.taps);
        positions [N]: their absolute positions; slot_mapping [N]: their slots (-1 skips);
        kv_caches: per draft layer (k_cache, v_cache[, k_scale, v_scale]) page views.
        """
        config, caches = self.config, self._caches(kv_caches)
        width = len(config.target_layer_ids) * config.hidden_size
        if taps.dim() != 2 or taps.shape[1] != width:
            raise ValueError(f"taps must be [N, {width}] (n_taps * hidden_size), got {tuple(taps.shape)}")
        _check_rows("positions", positions, 1, taps.shape[0])
        _check_rows("slot_mapping", slot_mapping, 1, taps.shape[0])
        tokens, layers = taps.shape[0], config.num_hidden_layers
        heads, head_dim = config.num_key_value_heads, config.head_dim
        context = rms_norm(linear(taps.to(self.fc.dtype), self.fc), self.hidden_norm, config.rms_norm_eps)
        kv = linear(context, self.kv_proj).view(tokens, layers, 2, heads, head_dim)  # one GEMM, all layers
        cos, sin = self.rotary.cos_sin(positions)  # one position per token
        k_norm = self.k_norm.view(layers, head_dim)
        for layer, cache in enumerate(caches):  # k normed and rotated, k and v stored: one launch a layer
            norm_rope_store(None, kv[:, layer, 0], kv[:, layer, 1], None, k_norm[layer], cos, sin,
                            config.rms_norm_eps, cache.k_cache, cache.v_cache, slot_mapping,
                            k_scale=cache.k_scale, v_scale=cache.v_scale)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, kv_caches: Sequence, embed: torch.Tensor, lm_head: torch.Tensor,
                num_speculative_tokens: int, *, return_logits: bool = False) -> DraftOutput:
        """Draft K = num_speculative_tokens tokens per sequence from one non-causal block forward.

        embed, lm_head: the target's [V, H] embedding table and output projection (shared, not copied).
        """
        config, caches, num_draft = self.config, self._caches(kv_caches), num_speculative_tokens
        if not 1 <= num_draft <= config.block_size - 1:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{config.block_size - 1} (block_size - 1), "
                f"got {num_draft}"
            )
        for name, weight in (("embed", embed), ("lm_head", lm_head)):
            shape_ok = weight.dim() == 2 and weight.shape[1] == config.hidden_size
            if not shape_ok or weight.shape[0] <= self.mask_token_id:
                raise ValueError(f"{name} must be [V, {config.hidden_size}] with V > mask_token_id, "
                                 f"got {tuple(weight.shape)}")
        offsets = torch.arange(num_draft + 1, device=batch.bonus_tokens.device)
        ids = torch.full((batch.num_seqs, num_draft + 1), self.mask_token_id, device=offsets.device)
        ids[:, 0] = batch.bonus_tokens
        cos, sin = self.rotary.cos_sin(batch.start_positions[:, None] + offsets)  # [B, K+1, D]
        x = F.embedding(ids, embed).to(self.fc.dtype)  # [B, K+1, H]
        kv_proj = self.kv_proj.view(config.num_hidden_layers, 2 * self.kv_rows, config.hidden_size)
        k_norm = self.k_norm.view(config.num_hidden_layers, config.head_dim)
        delta = None
        for index, layer in enumerate(self.layers):
            x, delta = layer(x, delta, kv_proj[index], k_norm[index], cos, sin, batch, caches[index])
        # the last layer's add, in the final norm; block position k: position start + k
        out, _ = rms_norm(delta[:, 1:], self.norm, config.rms_norm_eps, residual=x[:, 1:])
        logits = linear(out.to(lm_head.dtype), lm_head)  # [B, K, V]; the argmax needs no fp32 copy
        return DraftOutput(logits.argmax(dim=-1), logits.float() if return_logits else None)

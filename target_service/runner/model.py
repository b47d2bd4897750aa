"""The target LLM (Qwen3 or Llama 3 decoder) running over the pool's pages.

One forward serves a packed batch of prefill chunks, verify blocks and decodes: every layer
stores this step's K/V into its page views and attends causally over each sequence's pages
(`kernels.paged_attention`). It returns logits for the requested rows and, for the drafter, the
hidden states of the tapped layers for the requested rows.

Tap semantics (docs/architecture.md section 7): taps[i] is the output of decoder layer target_layer_ids[i],
i.e. HF `hidden_states[i + 1]`. HF replaces its last hidden state by the final-normed one, so a
tap on the last layer is final-normed here too: that is what DFlash drafters were trained on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from foundation.checkpoint_config import TargetConfig
from foundation.layer_cache import LayerCache, as_layer_caches
from foundation.weights import WeightSlot, empty_param, token_tables_layout
from kernels import paged_attention
from kernels.fused_layers import rms_norm, silu_and_mul
from kernels.layers import RotaryEmbedding
from kernels.linear import linear
from kernels.qkv_epilogue import norm_rope_store
from target_service.runner.forward_batch import ForwardBatch

QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)


class TargetOutput(NamedTuple):
    """logits [R, V] for batch.logits_indices and taps [R', n_taps * H] for tap_indices, both in the model's
    dtype: an argmax of bf16 logits is the argmax of their fp32 upcast (exact, ties included), and
    sampling casts them itself (`filter_logits`), so no fp32 copy of every row (311 MB at 512 rows) is
    written and read back."""

    logits: torch.Tensor
    taps: torch.Tensor


class TargetLayer(nn.Module):
    """One pre-norm decoder layer; q/k/v and gate/up are fused into one GEMM each."""

    def __init__(self, config: TargetConfig, dtype: torch.dtype, device):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, head_dim,
        )
        self.eps = config.rms_norm_eps
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.input_layernorm = empty_param([hidden], dtype, device)
        self.qkv_proj = empty_param([qkv_rows, hidden], dtype, device)
        self.qkv_bias = empty_param([qkv_rows], dtype, device) if config.attention_bias else None
        qk_norm = config.architecture in QK_NORM_ARCHITECTURES
        self.q_norm = empty_param([head_dim], dtype, device) if qk_norm else None
        self.k_norm = empty_param([head_dim], dtype, device) if qk_norm else None
        self.o_proj = empty_param([hidden, self.num_heads * head_dim], dtype, device)
        self.o_bias = empty_param([hidden], dtype, device) if config.attention_bias else None
        self.post_attention_layernorm = empty_param([hidden], dtype, device)
        self.gate_up_proj = empty_param([2 * config.intermediate_size, hidden], dtype, device)
        self.down_proj = empty_param([hidden, config.intermediate_size], dtype, device)

    def forward(self, h, delta, cos, sin, batch: ForwardBatch, cache: LayerCache):
        """One layer over the residual stream h + delta [T, H] (delta None: h alone).

        The previous layer's last add is deferred into this layer's input norm (one kernel for both),
        as this layer's own last add is left to the next: returns (h + delta, the stream entering
        this layer, i.e. the previous layer's output; h', the stream before this layer's MLP
        output; delta', that output). This step's K/V are stored before attention reads them.
        """
        tokens = h.shape[0]
        if delta is None:
            x = rms_norm(h, self.input_layernorm, self.eps)  # one fused kernel on a GPU (fused_layers)
        else:
            x, h = rms_norm(delta, self.input_layernorm, self.eps, residual=h)
        entering = h
        q, k, v = linear(x, self.qkv_proj, self.qkv_bias).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], dim=-1,
        )
        # Qwen3: per-head RMSNorm before RoPE (q_norm / k_norm); Llama: RoPE alone. One launch with the
        # K/V store (kernels.qkv_epilogue).
        q = norm_rope_store(
            q.reshape(tokens, self.num_heads, self.head_dim),
            k.reshape(tokens, self.num_kv_heads, self.head_dim),
            v.reshape(tokens, self.num_kv_heads, self.head_dim), self.q_norm, self.k_norm, cos, sin, self.eps,
            cache.k_cache, cache.v_cache, batch.slot_mapping, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )
        attn = paged_attention(
            q, cache.k_cache, cache.v_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
            scale=self.head_dim**-0.5, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )
        attn_out = linear(attn.reshape(tokens, -1), self.o_proj, self.o_bias)
        mlp_in, h = rms_norm(attn_out, self.post_attention_layernorm, self.eps, residual=h)
        return entering, h, linear(silu_and_mul(linear(mlp_in, self.gate_up_proj)), self.down_proj)


def target_weight_layout(config: TargetConfig) -> dict[str, WeightSlot]:
    """HF tensor name -> where it lands in TargetModel (fused q/k/v and gate/up rows)."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layout = {**token_tables_layout(config), "model.norm.weight": WeightSlot("norm", 0, (hidden,))}
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
        for name, (row, rows) in attn.items():
            layout[f"{src}self_attn.{name}_proj.weight"] = WeightSlot(dst + "qkv_proj", row, (rows, hidden))
            if config.attention_bias:
                layout[f"{src}self_attn.{name}_proj.bias"] = WeightSlot(dst + "qkv_bias", row, (rows,))
        layout[f"{src}self_attn.o_proj.weight"] = WeightSlot(dst + "o_proj", 0, (hidden, q_rows))
        if config.attention_bias:
            layout[f"{src}self_attn.o_proj.bias"] = WeightSlot(dst + "o_bias", 0, (hidden,))
        if config.architecture in QK_NORM_ARCHITECTURES:
            layout[f"{src}self_attn.q_norm.weight"] = WeightSlot(dst + "q_norm", 0, (head_dim,))
            layout[f"{src}self_attn.k_norm.weight"] = WeightSlot(dst + "k_norm", 0, (head_dim,))
        for name in ("input_layernorm", "post_attention_layernorm"):
            layout[f"{src}{name}.weight"] = WeightSlot(dst + name, 0, (hidden,))
        layout[f"{src}mlp.gate_proj.weight"] = WeightSlot(dst + "gate_up_proj", 0, (inter, hidden))
        layout[f"{src}mlp.up_proj.weight"] = WeightSlot(dst + "gate_up_proj", inter, (inter, hidden))
        layout[f"{src}mlp.down_proj.weight"] = WeightSlot(dst + "down_proj", 0, (hidden, inter))
    return layout


class TargetModel(nn.Module):
    """Qwen3ForCausalLM / LlamaForCausalLM over paged K/V. Weights start uninitialised: load them
    with `target_service.runner.checkpoint.load_target` (or `load_weights` plus `target_weight_layout`).
    """

    def __init__(self, config: TargetConfig, *, tap_layer_ids: Iterable[int] = (),
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.tap_layer_ids = tuple(tap_layer_ids)
        bad = [i for i in self.tap_layer_ids if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise ValueError(
                f"tap_layer_ids {bad} are outside the target's layers 0..{config.num_hidden_layers - 1}"
            )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)
        hidden = config.hidden_size
        self.embed_tokens = empty_param([config.vocab_size, hidden], dtype, device)
        layers = config.num_hidden_layers
        self.layers = nn.ModuleList(TargetLayer(config, dtype, device) for _ in range(layers))
        self.norm = empty_param([hidden], dtype, device)
        # tied checkpoints share one tensor: the lm_head IS the embedding table
        tied = config.tie_word_embeddings
        self.lm_head = self.embed_tokens if tied else empty_param([config.vocab_size, hidden], dtype, device)

    @property
    def embed_weight(self) -> torch.Tensor:
        """[V, H] token embeddings (the drafter embeds its noise block with these)."""
        return self.embed_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] output projection (the drafter's logits use it; the embedding itself when tied)."""
        return self.lm_head

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: Sequence) -> TargetOutput:
        """Run the packed batch through every layer, writing its K/V into the pages.

        kv_caches: per layer (k_cache, v_cache[, k_scale, v_scale]) views
        [num_blocks, tokens_per_block, NKV, D] of the target group's arena.
        """
        config = self.config
        caches = as_layer_caches(kv_caches, config.num_hidden_layers, config.num_key_value_heads,
                                 config.head_dim)
        cos, sin = self.rotary.cos_sin(batch.positions)
        h, delta = F.embedding(batch.input_ids, self.embed_tokens), None
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            entering, h, delta = layer(h, delta, cos, sin, batch, caches[i])
            if i - 1 in self.tap_layer_ids:  # layer i - 1's output: the stream entering layer i
                tapped[i - 1] = entering[batch.tap_indices]
        # The last layer's output, h + delta, is summed by the final norm, on the rows that need it.
        last = config.num_hidden_layers - 1
        if last in self.tap_layer_ids:  # final-normed, as HF's last hidden state
            tap_rows = batch.tap_indices
            tapped[last], _ = rms_norm(delta[tap_rows], self.norm, config.rms_norm_eps, residual=h[tap_rows])
        rows = batch.logits_indices
        out, _ = rms_norm(delta[rows], self.norm, config.rms_norm_eps, residual=h[rows])
        logits = linear(out, self.lm_head)
        taps = [tapped[i] for i in self.tap_layer_ids]
        taps = torch.cat(taps, dim=-1) if taps else h.new_empty(batch.tap_indices.shape[0], 0)
        return TargetOutput(logits, taps)

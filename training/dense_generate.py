"""Batched continuations from a dense target with a KV cache: the drafter's training text, fast.

Drafter training wants tens of thousands of target continuations. The serving engine makes them
one scheduler step at a time, with per-sequence bookkeeping that costs ~50 ms a step at batch 256
on a GPU; here every prompt has the same length, so a whole batch is one dense tensor, the cache
is a preallocated [b, NKV, P + max_tokens, D] per layer, and a step is a handful of launches.

The math is DenseQwen3's (the same modules and weights, so the same model the engine serves):
a prefill over the prompts, then one token per step attending over the cache. Greedy by default;
a temperature samples from softmax(logits / T). A row that emits EOS keeps generating (the batch
stays dense) and is cut after its first EOS afterwards, as the engine would stop it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.dense_target import Attention, DenseQwen3
from training.loop import autocast


def _attend_cached(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache_k: torch.Tensor, cache_v: torch.Tensor, start: int) -> torch.Tensor:
    """x [b, T, H] (input-normed) at positions start..start+T-1; writes its K/V into the caches
    [b, NKV, S, D] and attends causally over positions 0..start+T-1."""
    q, k, v = attn.qkv(x, cos, sin)
    end = start + x.shape[1]
    cache_k[:, :, start:end] = k.transpose(1, 2).to(cache_k.dtype)
    cache_v[:, :, start:end] = v.transpose(1, 2).to(cache_v.dtype)
    keys, values = cache_k[:, :, :end], cache_v[:, :, :end]
    # a prefill (start 0) is plain causal; a decode step (T = 1) sees every cached key
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                         is_causal=start == 0 and x.shape[1] > 1, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).flatten(-2))


def _forward_cached(model: DenseQwen3, ids: torch.Tensor, caches: list, start: int) -> torch.Tensor:
    """Last-position logits [b, V] (fp32) for ids [b, T] at positions start..start+T-1."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    cos, sin = model.rotary.cos_sin(positions)
    h = model.model.embed_tokens(ids)
    for layer, (cache_k, cache_v) in zip(model.model.layers, caches):
        h = h + _attend_cached(layer.self_attn, layer.input_layernorm(h), cos, sin, cache_k, cache_v, start)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    out = model.model.norm(h[:, -1])
    return F.linear(out, model.lm_head_weight).float()


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_batch(model: DenseQwen3, prompts: torch.Tensor, max_tokens: int, *, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """prompts [b, P] int64 on the model's device -> the next max_tokens ids of each row [b, max_tokens]."""
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [b, P] with P >= 1, got {tuple(prompts.shape)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    config = model.config
    batch, prompt_len = prompts.shape
    if prompt_len + max_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the target's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    device = prompts.device
    cache_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (batch, config.num_key_value_heads, prompt_len + max_tokens, config.head_dim)
    caches = [(torch.empty(shape, dtype=cache_dtype, device=device),
               torch.empty(shape, dtype=cache_dtype, device=device)) for _ in model.model.layers]
    out = torch.empty(batch, max_tokens, dtype=torch.long, device=device)
    with autocast(device):
        token = _pick(_forward_cached(model, prompts, caches, 0), temperature, generator)
        for i in range(max_tokens):
            out[:, i] = token
            if i + 1 < max_tokens:
                logits = _forward_cached(model, token[:, None], caches, prompt_len + i)
                token = _pick(logits, temperature, generator)
    return out


def cut_at_eos(rows: torch.Tensor, eos_id: int | None) -> list[list[int]]:
    """Each row up to and including its first EOS (what the engine returns for a stopped sequence)."""
    result = []
    for row in rows.tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        result.append(row)
    return result


def generate_continuations(model: DenseQwen3, prompts: list[list[int]], *, max_tokens: int,
                           temperature: float, eos_id: int | None, seed: int, batch: int) -> list[list[int]]:
    """The continuation of every prompt (all of one length), `batch` prompts per dense batch."""
    if not prompts:
        return []
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("dense generation needs prompts of one length")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature else None
    continuations: list[list[int]] = []
    for first in range(0, len(prompts), batch):
        chunk = torch.tensor(prompts[first: first + batch], dtype=torch.long, device=device)
        continuations += cut_at_eos(generate_batch(model, chunk, max_tokens, temperature=temperature,
                                                   generator=generator), eos_id)
    return continuations

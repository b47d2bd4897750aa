"""DFlash training blocks: anchor sampling, the block attention mask, labels and loss weights.

One training sequence of S tokens carries n blocks. Block j starts at anchor p_j: its input is
[x_{p_j}, MASK x (B-1)] at positions p_j..p_j+B-1, and block position k (k >= 1) is trained to predict
x_{p_j+k}. What a block may see mirrors inference exactly (docs/architecture.md section 7):
  - the target's context at positions strictly before its anchor (kv < p_j: at inference the
    bonus token at `start` has no context entry yet);
  - all B positions of its own block, bidirectionally;
  - nothing of any other block.
The mask is laid out per block, [b, n, B, S + B]: columns 0..S-1 are the context, S..S+B-1 the
block's own positions, so attention costs n*B*(S+B) rather than (n*B)^2 for a joint layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Blocks(NamedTuple):
    """n blocks per sequence.

    anchors [b, n] int64 (sorted; 0 where unused), keep [b, n] bool (a real block, not padding),
    noise_ids [b, n, B], positions [b, n, B], labels [b, n, B] (x_{p+k}; block position 0 unused),
    weights [b, n, B] float32 (0 where no loss), mask [b, n, B, S + B] bool (True: may attend).
    """

    anchors: torch.Tensor
    keep: torch.Tensor
    noise_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor


def loss_decay(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weights per block position: 0 for 0, exp(-(k-1)/gamma) for k >= 1 (DFlash Eq. 4)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be positive, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def default_gamma(block_size: int) -> float:
    """7 for B=16, 5 for B=10, 4 for B=8 (the released recipe); in between, B/2 - 1 rounded up."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, float(-(-block_size // 2) - 1)))


def sample_anchors(lengths: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` distinct anchors per sequence, uniformly, sorted: (anchors, keep) [b, n].

    lengths [b]: real tokens per row (the rest is padding); loss_mask [b, S] bool: positions whose
    token may be a label. Anchor p is valid when p + 1 < length and loss_mask[p + 1] (its block has
    at least one label). Rows with fewer valid anchors than n are padded with keep=False.
    """
    batch, seq_len = loss_mask.shape
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [{batch}], got {tuple(lengths.shape)}")
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be at least 1, got {num_anchors}")
    p = torch.arange(seq_len, device=loss_mask.device)
    next_in_loss = torch.zeros_like(loss_mask)
    next_in_loss[:, :-1] = loss_mask[:, 1:]
    valid = next_in_loss & (p[None, :] + 1 < lengths[:, None])
    keys = torch.rand(batch, seq_len, generator=generator, device=loss_mask.device)
    keys = torch.where(valid, keys, torch.full_like(keys, -1.0))  # invalid positions rank last
    n = min(num_anchors, seq_len)
    picked = keys.topk(n, dim=1).indices  # a uniform sample without replacement among the valid ones
    keep = torch.arange(n, device=p.device)[None, :] < valid.sum(1, keepdim=True)
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    # sort the real anchors ascending, padding (keep=False) after them
    order = torch.where(keep, anchors, torch.full_like(anchors, seq_len)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def build_blocks(input_ids: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor,
                 anchors: torch.Tensor, keep: torch.Tensor, *, block_size: int, mask_token_id: int,
                 gamma: float) -> Blocks:
    """Noise ids, positions, labels, weights and the per-block mask for anchors [b, n]."""
    batch, seq_len = input_ids.shape
    device = input_ids.device
    k = torch.arange(block_size, device=device)
    positions = anchors[..., None] + k  # [b, n, B]
    clamped = positions.clamp(max=seq_len - 1)
    labels = input_ids.gather(1, clamped.flatten(1)).view_as(positions)
    in_seq = positions < lengths[:, None, None]
    in_loss = loss_mask.gather(1, clamped.flatten(1)).view_as(positions)
    decay = loss_decay(block_size, gamma).to(device)
    weights = (keep[..., None] & in_seq & in_loss).float() * decay
    noise_ids = torch.full_like(positions, mask_token_id)
    noise_ids[..., 0] = torch.where(keep, labels[..., 0], torch.full_like(anchors, mask_token_id))
    context = torch.arange(seq_len, device=device)
    sees_context = (context < anchors[..., None]) & keep[..., None]  # [b, n, S]: strictly before
    mask = torch.cat([
        sees_context[:, :, None, :].expand(batch, anchors.shape[1], block_size, seq_len),
        torch.ones(batch, anchors.shape[1], block_size, block_size, dtype=torch.bool, device=device),
    ], dim=-1)
    return Blocks(anchors, keep, noise_ids, positions, labels, weights, mask)


def weighted_block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy) over block positions 1..B-1: sum w * CE / sum w; accuracy where w > 0.

    logits [b, n, B-1, V] for block positions 1..B-1; labels, weights [b, n, B] (position 0 dropped here).
    """
    labels, weights = labels[..., 1:], weights[..., 1:]
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    total = weights.sum()
    loss = (ce * weights.flatten()).sum() / total.clamp(min=1e-6)
    counted = weights > 0
    hits = (logits.argmax(-1) == labels) & counted
    accuracy = hits.sum() / counted.sum().clamp(min=1)
    return loss, accuracy

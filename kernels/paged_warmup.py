"""Compile, before serving, every variant of the paged attention kernel a step can launch.

The kernel's launch plan (`paged_attention.plan_launch`: tiles, split, fused merge, sequence search)
follows from the batch's static shape, its query rows T and sequences B, so the variants a server
meets are those of every (T, B) with B <= T <= max_num_batched_tokens and B <= max_num_seqs. A step
that reached a variant first while serving compiled it on the spot, and every stream of the replica
waited (1-4 s each on an H200, for minutes after start-up as new mixes of prefill and decode came).

`reachable_variants` finds one (T, B) per variant without planning every pair: within one mean
query length the tiles are fixed, and the plan changes with T only through its query-tile count
until the work items fill the GPU; `warm_up` launches each on a tiny context over the real pages.
"""

from __future__ import annotations

import logging
import time

import torch
import triton

from kernels import split_kv
from kernels.paged_attention import paged_attention, plan_launch

logger = logging.getLogger(__name__)


def reachable_variants(max_tokens: int, max_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       device: torch.device, cache_dtype: torch.dtype, q_dtype: torch.dtype
                       ) -> dict[tuple, tuple[int, int]]:
    """variant -> one (T, B) that launches it, over every B <= T <= max_tokens, B <= max_seqs."""
    plan = lambda tokens, seqs: plan_launch(tokens, seqs, num_heads, num_kv_heads, head_dim, device,
                                            cache_dtype, q_dtype)
    # past this many work items the split plan no longer changes (one split from `num_sms`; the
    # double-buffering rule looks at up to WAVES waves)
    saturated = split_kv.WAVES * split_kv.num_sms(device) + 1
    found: dict[tuple, tuple[int, int]] = {}
    for seqs in range(1, min(max_seqs, max_tokens) + 1):
        for mean_q in range(1, triton.cdiv(max_tokens, seqs) + 1):
            low = seqs if mean_q == 1 else (mean_q - 1) * seqs + 1
            high = min(mean_q * seqs, max_tokens)
            block_q = plan(low, seqs).tiles.block_q
            tokens = low
            while tokens <= high:
                found.setdefault(plan(tokens, seqs).variant, (tokens, seqs))
                if max(seqs, triton.cdiv(tokens, block_q)) * num_kv_heads >= saturated:
                    found.setdefault(plan(high, seqs).variant, (high, seqs))
                    break
                tokens = triton.cdiv(tokens, block_q) * block_q + 1  # the next query-tile count
    return found


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale, *, num_heads: int,
            q_dtype: torch.dtype, max_tokens: int, max_seqs: int) -> int:
    """Launch every reachable variant once over `k_cache`/`v_cache` (one layer's pages, read only:
    nothing is stored) with `k_scale`/`v_scale` as the model passes them. Returns the count."""
    device, num_kv_heads, head_dim = k_cache.device, k_cache.shape[2], k_cache.shape[3]
    started = time.perf_counter()
    variants = reachable_variants(max_tokens, max_seqs, num_heads, num_kv_heads, head_dim, device,
                                  k_cache.dtype, q_dtype)
    q = torch.zeros(max_tokens, num_heads, head_dim, dtype=q_dtype, device=device)
    for tokens, seqs in variants.values():
        q_lens = torch.full((seqs,), tokens // seqs, dtype=torch.int32)
        q_lens[: tokens % seqs] += 1
        query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(q_lens, 0)
        pages = triton.cdiv(int(q_lens.max()), k_cache.shape[1])
        block_table = torch.zeros(seqs, pages, dtype=torch.int32)  # every sequence reads page 0 on
        paged_attention(q[:tokens], k_cache, v_cache, block_table.to(device), q_lens.to(device),
                        query_start_loc.to(device), k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize(device)
    logger.info("paged attention: %d launch variants compiled or loaded in %.1f s (T <= %d, B <= %d)",
                len(variants), time.perf_counter() - started, max_tokens, max_seqs)
    return len(variants)

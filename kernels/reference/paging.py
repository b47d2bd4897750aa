"""Gathering a sequence's tokens out of pages, and the fp8 scale convention."""

from __future__ import annotations

import torch


def scale_value(scale) -> float | torch.Tensor:
    """A Python float or 0-d tensor scale as something that multiplies; None means 1."""
    if scale is None:
        return 1.0
    return scale.float() if isinstance(scale, torch.Tensor) else float(scale)


def gather_pages(cache: torch.Tensor, block_row: torch.Tensor, length: int, scale=None) -> torch.Tensor:
    """Tokens 0..length-1 of one sequence as fp32 [length, NKV, D].

    cache: [num_blocks, tokens_per_block, NKV, D] (any strides, any dtype incl. fp8);
    block_row: [max_blocks] int block ids of the sequence; scale dequantizes fp8.
    """
    tokens_per_block = cache.shape[1]
    num_pages = -(-length // tokens_per_block)
    pages = cache[block_row[:num_pages].long()]  # [pages, tpb, NKV, D]
    tokens = pages.reshape(-1, *cache.shape[2:])[:length]
    return tokens.float() * scale_value(scale)

"""The KV budget on a GPU: a fraction of the device after the weights and a profiling forward."""

from __future__ import annotations

import logging

import torch

from target_service.runner.forward_batch import SeqChunk, pack

logger = logging.getLogger(__name__)

PROFILE_TOKENS_PER_BLOCK = 16


@torch.inference_mode()
def profile_activation_bytes(target, device: torch.device, num_tokens: int) -> int:
    """Peak bytes a forward of `num_tokens` prefill tokens needs beyond weights and its K/V."""
    config = target.config
    blocks = -(-num_tokens // PROFILE_TOKENS_PER_BLOCK)
    shape = (blocks, PROFILE_TOKENS_PER_BLOCK, config.num_key_value_heads, config.head_dim)
    dtype = target.embed_weight.dtype
    caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
              for _ in range(config.num_hidden_layers)]
    tokens = [i % config.vocab_size for i in range(num_tokens)]
    batch = pack([SeqChunk(tokens, 0, list(range(blocks)), 1, num_tokens if target.tap_layer_ids else 0)],
                 PROFILE_TOKENS_PER_BLOCK, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    target(batch, caches)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches
    torch.cuda.empty_cache()
    return peak


def device_kv_budget(target, device: torch.device, utilization: float, num_tokens: int) -> int:
    """utilization x device memory, minus what is in use (weights, other processes) and activations."""
    activations = profile_activation_bytes(target, device, num_tokens)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - activations
    logger.info("KV budget %d bytes: %.2f of %d, %d in use, %d for activations", budget, utilization, total,
                total - free, activations)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no memory for the KV pool "
                         f"({total - free} bytes in use, {activations} needed for activations)")
    return budget

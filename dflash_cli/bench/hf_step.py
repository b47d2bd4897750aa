"""The reference the step bench sets beside the engine: HF transformers eager over the same checkpoint."""

from __future__ import annotations

import time

import torch

from dflash_cli.bench.step_timing import spread, sync


@torch.inference_mode()
def hf_case(model, batch: int, context: int, k: int, vocab: int, steps: int, seed: int) -> dict:
    """HF eager: one decode step of B sequences after a C-token prefill, and a verify of K+1 tokens."""
    from transformers import DynamicCache

    device = model.device
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab - 2, (batch, context), generator=generator).to(device)
    cache = DynamicCache()
    model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    decode, verify = [], []
    token = torch.randint(3, vocab - 2, (batch, 1), generator=generator).to(device)
    block = torch.randint(3, vocab - 2, (batch, k + 1), generator=generator).to(device)
    for _ in range(steps + 1):  # the first of each is a warm-up; the cache is cropped back each time
        for ids, times in ((token, decode), (block, verify)):
            sync(device)
            started = time.perf_counter()
            model(ids, past_key_values=cache, use_cache=True)
            sync(device)
            times.append(time.perf_counter() - started)
            cache.crop(-ids.shape[1])
    del cache
    return {"decode": spread(decode[1:]), "verify": spread(verify[1:])}

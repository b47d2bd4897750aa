"""Eager forwards at start-up over the row counts a mixed step can take, so the first users of a fresh
server do not pay for first uses that lie outside Triton.

A step that mixes prefill chunks with decodes runs the target eagerly (the CUDA graphs cover only the
uniform decode and verify steps), and its matrix products see row counts that no graph capture saw:
the prompt tokens of the step plus its verify rows, and for the vocabulary projection the step's
logits rows. The first product of a new row class makes the BLAS library pick a kernel and, with
CUDA's lazy module loading, load it; the first forward of a new size grows the caching allocator.
Both then happen inside a step every running stream waits for. `warm_up_forwards` runs one forward
per rung of a geometric ladder of row counts (and of logits rows) up to the step's largest, over the
pool's own pages before anything is served: no sequence holds a page yet, and every page a sequence
later reads it has written first.

What it saves is not shown: on an H100 a fresh plain server's first-pass longest gap was 73 ms
without it and 96 ms with it, one run each (`bench/results/serving_h100.md`; the 96 ms was a
decode-only step, which no first use here explains). It costs about 1 s of start-up.
"""

from __future__ import annotations

import logging
import time

import torch

from target_service.runner.forward_batch import SeqChunk, pack

logger = logging.getLogger(__name__)

LADDER_RATIO = 1.25  # neighbouring rungs differ by a quarter: finer than the BLAS heuristics' classes


def ladder(low: int, high: int, ratio: float = LADDER_RATIO) -> list[int]:
    """low, then each previous rung times `ratio` (at least one more), up to and including high."""
    if not 1 <= low <= high:
        raise ValueError(f"a ladder needs 1 <= low <= high, got {low}..{high}")
    rungs = [low]
    while rungs[-1] < high:
        rungs.append(min(high, max(rungs[-1] + 1, int(rungs[-1] * ratio))))
    return rungs


@torch.inference_mode()
def warm_up_forwards(target, caches, *, tokens_per_block: int, max_rows: int, max_logits: int) -> int:
    """One forward of the target over `caches` per rung of the row ladder (1..max_rows), the rungs of
    the logits ladder (1..max_logits) dealt out among them. Writes K/V into the first pages of the
    pool, which must hold nothing yet. Returns the forwards run."""
    rows, logits = ladder(1, max_rows), ladder(1, min(max_logits, max_rows))
    device, vocab = target.embed_weight.device, target.config.vocab_size
    taps = bool(target.tap_layer_ids)
    started = time.perf_counter()
    for i, count in enumerate(rows):
        token_ids = [(7 * j + i) % vocab for j in range(count)]  # anything in the vocabulary
        blocks = list(range(-(-count // tokens_per_block)))
        chunk = SeqChunk(token_ids, 0, blocks, num_logits=min(count, logits[i % len(logits)]),
                         num_taps=count if taps else 0)
        target(pack([chunk], tokens_per_block, device), caches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warm-up: %d eager forwards of 1..%d rows (1..%d logits rows) in %.2f s", len(rows),
                max_rows, logits[-1], time.perf_counter() - started)
    return len(rows)

"""Step time against the engine's limits: max_num_seqs and the pool's size (part of dflash_cli.bench.step).

A served engine is started with limits far above the batch it runs at a given moment: max_num_seqs
sizes the step buffers and the largest captured CUDA graph, the pool's size sets how many pages
exist. Neither should change what one step of B sequences costs (the graphs are captured per padded
batch size, the attention plans from the batch, the block tables are max_model_len wide whatever
the pool). This sweep measures it: for each max_num_seqs (at the grid's pool size) and each pool
size (at the grid's max_num_seqs) one DFlash engine is started (startup timed: weights, pool,
graph capture), then each batch size of the sweep is timed as in the grid (from CUDA graphs over
the rounds, and eagerly).
"""

from __future__ import annotations

import gc
import logging
import time

import torch

logger = logging.getLogger(__name__)


def limit_configs(max_num_seqs: list[int], kv_cache_memory: list[str], *, default_seqs: int,
                  default_memory: str | None) -> list[tuple[int, str | None]]:
    """(max_num_seqs, kv_cache_memory) pairs: each max_num_seqs at the default pool, then each pool at
    the default max_num_seqs; the default pair once."""
    configs = [(seqs, default_memory) for seqs in max_num_seqs]
    configs += [(default_seqs, memory) for memory in kv_cache_memory]
    return list(dict.fromkeys(configs))


def limits_sweep(make_llm, case, configs: list[tuple[int, str | None]], batch_sizes: list[int],
                 context: int) -> list[dict]:
    """One row per (config, batch): `make_llm(max_num_seqs, kv_cache_memory)` starts a DFlash engine,
    `case(llm, batch, context)` times it (dflash_cli.bench.step_timing.engine_case). A batch above
    max_num_seqs is left out; an engine that cannot start (a pool too small for max_model_len) is
    recorded as such."""
    rows = []
    for max_num_seqs, memory in configs:
        config = {"max_num_seqs": max_num_seqs, "kv_cache_memory": memory or "default"}
        started = time.perf_counter()
        try:
            llm = make_llm(max_num_seqs, memory)
        except ValueError as error:
            rows.append({**config, "error": str(error)})
            continue
        startup_s = round(time.perf_counter() - started, 2)
        try:
            for batch in batch_sizes:
                if batch > max_num_seqs:
                    continue
                result = case(llm, batch, context)
                kept = {key: result[key] for key in ("batch", "context", "prefill_s", "graphs", "eager")
                        if key in result}
                rows.append({**config, "startup_s": startup_s,
                             "pool_blocks": llm.engine.pool_limits.num_blocks, **kept})
                logger.info("limits: max_num_seqs %d, pool %s, B %d done", max_num_seqs,
                            config["kv_cache_memory"], batch)
        finally:
            llm.close()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows

"""Requests admitted at equal memory, paged versus dense draft context (`bench.bench_serve_modes
--parts admission`): what `dflash plan` predicts, and what the engine does.

One KV budget (`--admission-memory`) for both storages. Dense reserves max_num_seqs x max_model_len
draft tokens up front (`size_pool`), so at a large max_num_seqs it cannot start at all; it is run at
its best max_num_seqs instead: the smallest that lets the plan's arithmetic run the most requests of
prompt + max_tokens tokens (generous to dense). Paged runs at `--admission-max-num-seqs`; its pool does
not depend on max_model_len (nothing is reserved for it), so it is built once, at the longest.

Each engine (the in-process engine of `dflash serve` and `LLM`, eager, prefix caching off) gets every
request at once and steps until the first request finishes: by then the running requests hold about
their full length, so the scheduler's running list shows what the memory sustains. Recorded per step:
the running list's length (with the requests that finished in that step) and the pool's used blocks;
also the preemptions (a request admitted on its prompt's blocks, preempted as it grows).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    """A target checkpoint and its drafter (both directories)."""

    target: Path
    drafter: Path


def pool_spec(pair: Pair, *, dtype: str | None, device: str | None):
    """The full pool spec (target and draft groups) the engine builds for this pair: the start-up
    plan's own reading of the configs, in the dtype the engine computes in."""
    from target_service.assembly.engine_args import EngineArgs
    from target_service.assembly.plan import resolve_plan

    args = EngineArgs(target=str(pair.target), drafter=str(pair.drafter), dtype=dtype, device=device)
    return resolve_plan(args).pool_spec()


def plan(spec, memory_bytes: int, *, max_model_len: int, max_num_seqs: int, avg_seq_len: int):
    """`dflash plan`'s arithmetic (kvpool_service.geometry.plan_pool, what `dflash_cli.plan` prints)."""
    from kvpool_service.geometry import plan_pool

    return plan_pool(spec, memory_bytes, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     avg_seq_len=avg_seq_len)


def best_dense_max_num_seqs(spec, memory_bytes: int, *, max_model_len: int, cap: int,
                            avg_seq_len: int) -> int:
    """The smallest max_num_seqs <= cap at which the plan's dense storage runs the most requests of
    avg_seq_len tokens; 0 when even one slot leaves no room."""
    best, most = 0, 0
    for slots in range(1, cap + 1):
        runs = plan(spec, memory_bytes, max_model_len=max_model_len, max_num_seqs=slots,
                    avg_seq_len=avg_seq_len).dense.concurrent_requests
        if runs > most:
            best, most = slots, runs
    return best


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded uniform token ids, away from the vocabulary's first and last rows."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size - 2) for _ in range(length)] for _ in range(count)]


def fill(assembly, prompts: list[list[int]], max_tokens: int, deadline: float | None) -> dict:
    """Submit every prompt at once, step until the first request finishes; the running list's and the
    pool's peaks (per step, after it: a request that finished in the step counts as running in it)."""
    from target_service.engine.sampling_params import SamplingParams

    engine = assembly.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"admit-{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    peak_running = peak_used = steps = 0
    first_finish = None
    started = time.perf_counter()
    while engine.has_unfinished and first_finish is None:
        finished = engine.step()
        steps += 1
        running = engine.num_running + len(finished)
        used = engine.pool_usage().num_used_blocks + sum(len(seq.block_table) for seq in finished)
        peak_running, peak_used = max(peak_running, running), max(peak_used, used)
        if finished:
            first_finish = {"step": steps, "running": running, "used_blocks": used}
        if deadline is not None and time.time() > deadline:
            break
    waiting = engine.num_waiting
    for request_id in ids:
        if engine.has_request(request_id):
            engine.abort(request_id)
    return {"steps": steps, "seconds": time.perf_counter() - started, "peak_running": peak_running,
            "peak_used_blocks": peak_used, "first_finish": first_finish, "waiting_at_end": waiting,
            "preemptions": engine.counters().num_preemptions, "cut_by_deadline": first_finish is None}


def engine_case(pair: Pair, storage: str, *, memory: int, max_model_len: int, max_num_seqs: int,
                prompts: list[list[int]], max_tokens: int, device: str | None, dtype: str | None,
                seed: int, deadline: float | None) -> dict:
    """Build the engine of one storage at this memory, fill it, release it."""
    from target_service.assembly.engine_args import EngineArgs
    from target_service.assembly.in_process import build_engine

    args = EngineArgs(target=str(pair.target), drafter=str(pair.drafter), context_storage=storage,
                      device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      kv_cache_memory=memory, enable_prefix_caching=False, enforce_eager=True, seed=seed)
    started = time.perf_counter()
    assembly = build_engine(args)
    try:
        sizing = assembly.pool.sizing
        record = {"storage": storage, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                  "build_s": time.perf_counter() - started, "pool_blocks": sizing.num_blocks,
                  "bytes_per_block": sizing.spec.bytes_per_block,
                  "dense_context_bytes": sizing.dense_context_bytes,
                  "tokens_per_block": sizing.spec.tokens_per_block}
        record.update(fill(assembly, prompts, max_tokens, deadline))
    finally:
        assembly.close()
    record["peak_held_bytes"] = record["peak_used_blocks"] * record["bytes_per_block"] + \
        record["dense_context_bytes"]  # dense holds its whole reservation from the start
    return record


def _plan_row(plan_result, storage: str, max_num_seqs: int) -> dict:
    chosen = getattr(plan_result, storage)
    return {"storage": storage, "max_model_len": plan_result.max_model_len, "max_num_seqs": max_num_seqs,
            "num_blocks": chosen.num_blocks, "draft_context_bytes": chosen.draft_context_bytes,
            "concurrent_requests": chosen.concurrent_requests, "uncapped_requests": chosen.uncapped_requests}


def run_admission(pair: Pair, options, deadline: float | None, release) -> dict:
    """Plans and engine cases of every `--admission-max-model-len`; `release()` frees the device
    between engines. options: the parsed flags (admission_* , device, dtype, seed)."""
    from dflash_cli.plan import render_plan
    from foundation.byte_size import parse_byte_size
    from foundation.checkpoint_config import load_target_config

    memory = parse_byte_size(options.admission_memory)
    spec = pool_spec(pair, dtype=options.dtype, device=options.device)
    avg = options.admission_prompt_len + options.admission_max_tokens
    cap = options.admission_max_num_seqs
    vocab = load_target_config(pair.target).vocab_size
    prompts = random_prompts(options.admission_requests, options.admission_prompt_len, vocab, options.seed)
    lengths = sorted(set(options.admission_max_model_len), reverse=True)
    result = {"memory_bytes": memory, "max_num_seqs": cap, "num_requests": options.admission_requests,
              "prompt_len": options.admission_prompt_len, "max_tokens": options.admission_max_tokens,
              "spec": spec.model_dump(), "plans": [], "plan_text": {}, "cases": [], "skipped": []}
    jobs = []
    for length in lengths:
        requested = plan(spec, memory, max_model_len=length, max_num_seqs=cap, avg_seq_len=avg)
        result["plan_text"][str(length)] = render_plan(spec, requested)
        dense_slots = options.admission_dense_max_num_seqs or best_dense_max_num_seqs(
            spec, memory, max_model_len=length, cap=cap, avg_seq_len=avg)
        result["plans"] += [_plan_row(requested, "paged", cap), _plan_row(requested, "dense", cap)]
        if dense_slots:
            at_best = plan(spec, memory, max_model_len=length, max_num_seqs=dense_slots, avg_seq_len=avg)
            result["plans"].append(_plan_row(at_best, "dense", dense_slots))
            jobs.append(("dense", length, dense_slots))
        else:
            result["skipped"].append({"storage": "dense", "max_model_len": length,
                                      "why": "one slot's reservation leaves no room for a request"})
    jobs.insert(0, ("paged", lengths[0], cap))
    for storage, length, slots in jobs:
        if deadline is not None and time.time() > deadline:
            result["skipped"].append({"storage": storage, "max_model_len": length, "why": "time budget"})
            continue
        result["cases"].append(engine_case(pair, storage, memory=memory, max_model_len=length,
                                           max_num_seqs=slots, prompts=prompts,
                                           max_tokens=options.admission_max_tokens, device=options.device,
                                           dtype=options.dtype, seed=options.seed, deadline=deadline))
        release()
    return result

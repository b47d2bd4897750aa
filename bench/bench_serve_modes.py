"""Plain, dense-context and paged-context serving at each concurrency, and the requests each storage
admits at equal memory: the HTTP app and engine `dflash serve` runs, without Ray Serve.

    python -m bench.bench_serve_modes [--target DIR --drafter DIR | --geometry qwen3-8b|tiny
        --checkpoints DIR] [--parts serve admission] [--modes plain dense paged]
        [--concurrency 1 2 4 8 16 32 64] [--input-len 1024] [--output-len 256] [--prompts-per-level 1]
        [--min-prompts 4] [--max-model-len 8192] [--kv-cache-memory SIZE] [--admission-memory 8GiB]
        [--admission-max-model-len 32768 8192] [--admission-max-num-seqs 256] [--admission-requests 128]
        [--admission-prompt-len 2048] [--admission-max-tokens 256] [--budget-s S] [--device D]
        [--name serve_modes_h200] [--out DIR]
    python -m bench.bench_serve_modes --replot bench/results/serve_modes_h200_now.json

Serving, one mode at a time on the whole device: plain (no drafter), dense (the drafter, its context in
per-sequence dense buffers) and paged (the drafter, its context in the pool). Each mode builds a
`target_service.serving.replica.Replica` (what every Ray Serve replica of `dflash serve` builds),
installs its server in a `ServerHolder` and serves `target_service.serving.api.create_app(holder)`
under uvicorn on 127.0.0.1, in a thread of this process; the load generator
(`dflash_cli.bench.serve_load`'s functions: closed loop, TTFT / TPOT / ITL from the SSE stream,
acceptance from /metrics) runs in a child process, so its Python does not share the server's
interpreter lock. Then the replica is closed and the device memory released before the next mode.
Admission: `bench.bench_serve_modes_admission`.

Without --target, a random-weight pair of the geometry is written once (`dflash_cli.bench.random_pair`, as
the step bench does) with a word-level stand-in tokenizer, so the server streams text. Random
weights are almost never accepted: plain against DFlash then measures what drafting costs.
Results: <out>/<name>.json, .md and .png, saved after every part (a run cut short keeps what it
measured); `--budget-s` skips what would start past the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.serve_in_process import TRANSPORT, memory_allocated, release_device, replica_server
from dflash_cli.bench.serve_load import (
    Endpoint,
    random_prompts,
    request_body,
    resolve_model,
    run_at_concurrency,
    run_setting,
    send_request,
)

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench_serve_modes")


@dataclass(frozen=True)
class Mode:
    name: str
    drafter: bool
    context_storage: str = "paged"


MODES = {mode.name: mode for mode in (Mode("plain", False), Mode("dense", True, "dense"),
                                      Mode("paged", True))}


def serve_args(mode: Mode, target: Path, drafter: Path, options: argparse.Namespace):
    """`dflash serve`'s settings for one mode (no admin port: nothing here reads it)."""
    from target_service.serving.serve_args import ServeArgs

    return ServeArgs(target=str(target), drafter=str(drafter) if mode.drafter else "none",
                     context_storage=mode.context_storage, device=options.device, dtype=options.dtype,
                     max_num_seqs=max(options.concurrency), max_model_len=options.max_model_len,
                     kv_cache_memory=options.kv_cache_memory, admin_port=None,
                     num_speculative_tokens=options.num_speculative_tokens if mode.drafter else None)


def replica_facts(replica) -> dict:
    """The engine behind the server: its pool and what it did over the run."""
    engine, sizing = replica.assembly.engine, replica.assembly.pool.sizing
    return {"pool_blocks": sizing.num_blocks, "tokens_per_block": sizing.spec.tokens_per_block,
            "bytes_per_block": sizing.spec.bytes_per_block, "dense_context_bytes": sizing.dense_context_bytes,
            "num_speculative_tokens": engine.num_speculative_tokens,
            "preemptions": engine.counters().num_preemptions,
            "engine_drafts": engine.stats.num_drafts, "engine_accepted": engine.stats.num_accepted_tokens}


# ---- the client side: serve_load's functions, in a child process ----------------------------------

def measure_levels(url: str, levels: list[tuple[int, list[list[int]]]], warmup: list[list[int]],
                   options: dict) -> dict:
    """In the client process: name the model, warm up (not counted), then each concurrency level."""
    return asyncio.run(_measure(url, levels, warmup, argparse.Namespace(**options)))


async def _measure(url: str, levels, warmup, options: argparse.Namespace) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=options.timeout, limits=limits) as client:
        endpoint = await resolve_model(client, Endpoint(url + "/v1"))
        warm_bodies = [request_body(endpoint.model, prompt, options.warmup_tokens, True) for prompt in warmup]

        async def warm_up(concurrency: int) -> None:
            """Requests of the measured length at this concurrency, so the first steps of a batch shape
            (kernel compiles, split planning) fall outside the measurement."""
            bodies = (warm_bodies * (1 + concurrency // max(1, len(warm_bodies))))[:concurrency]
            warm = await run_at_concurrency(lambda body: send_request(client, endpoint, body), bodies,
                                            concurrency)
            if any(not result.ok for result in warm):
                raise RuntimeError(f"warm-up failed: {sorted({r.error for r in warm if not r.ok})}")

        await warm_up(len(warm_bodies))
        settings, skipped = [], []
        for level, prompts in levels:
            if options.deadline is not None and time.time() > options.deadline:
                skipped.append(level)
                continue
            await warm_up(level)
            bodies = [request_body(endpoint.model, prompt, options.output_len, True) for prompt in prompts]
            settings.append(await run_setting(client, endpoint, bodies, "concurrency", level, options))
    return {"model": endpoint.model, "settings": settings, "skipped_levels": skipped}


def client_options(options: argparse.Namespace, deadline: float | None) -> dict:
    """What `serve_load.run_setting` reads, and the rest of the client's settings (picklable)."""
    return {"metrics_scrapes": 2, "progress": False, "seed": options.seed, "timeout": options.timeout,
            "output_len": options.output_len, "warmup_tokens": options.warmup_tokens, "deadline": deadline}


def prompts_at(level: int, options: argparse.Namespace) -> int:
    return max(options.min_prompts, options.prompts_per_level * level)


def level_prompts(tokenizer_dir: Path, options: argparse.Namespace) -> list[tuple[int, list[list[int]]]]:
    """Fresh prompts per level (a seed each), so no level hits the prefix cache an earlier one filled."""
    return [(level, random_prompts(tokenizer_dir, prompts_at(level, options), options.input_len,
                                   options.seed + level)) for level in options.concurrency]


def serve_mode(mode: Mode, target: Path, drafter: Path, options: argparse.Namespace, client, levels,
               warmup, deadline: float | None) -> dict:
    """One mode: start its server, run every level from the client process, stop it."""
    record = {"mode": mode.name, "drafter": mode.drafter, "context_storage": mode.context_storage}
    started = time.perf_counter()
    try:
        with replica_server(serve_args(mode, target, drafter, options)) as (url, replica):
            record["startup_s"] = time.perf_counter() - started
            logger.info("%s: serving on %s after %.1f s", mode.name, url, record["startup_s"])
            record.update(client.submit(measure_levels, url, levels, warmup,
                                        client_options(options, deadline)).result())
            record.update(replica_facts(replica))
    except Exception as error:  # one mode failing (memory, a dead engine) must not lose the others
        logger.exception("%s failed", mode.name)
        record["error"] = f"{type(error).__name__}: {error}"
    record["seconds"] = time.perf_counter() - started
    return record


# ---- checkpoints, device, the run ------------------------------------------------------------------

def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json (w0 .. wN-1) for a random-weight target, which has no vocabulary
    of its own: prompts go as token ids, and the streamed text needs something to decode to."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (directory / "tokenizer.json").is_file():
        return
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def checkpoints(options: argparse.Namespace) -> tuple[Path, Path, dict]:
    """(target, drafter, how they were made): the given pair, or a random one of the geometry."""
    if options.target:
        if not (Path(options.target) / "tokenizer.json").is_file():
            raise ValueError(f"--target: no tokenizer.json in {options.target} (prompts are drawn from it)")
        origin = {"origin": "given", "random_weights": False}
        return Path(options.target), Path(options.drafter), origin
    import torch

    from dflash_cli.bench.random_pair import write_random_pair
    from foundation.checkpoint_config import load_target_config

    on_cuda = torch.cuda.is_available() and options.device != "cpu"
    dtype = options.dtype or ("bfloat16" if on_cuda else "float32")
    target, drafter = write_random_pair(Path(options.checkpoints), options.geometry, dtype=dtype,
                                        seed=options.seed)
    write_word_tokenizer(target, load_target_config(target).vocab_size)
    return target, drafter, {"origin": f"random {options.geometry} weights, {dtype}", "random_weights": True}


def device_facts(options: argparse.Namespace) -> dict:
    import torch

    from dflash_cli.bench.serve_report import client_machine

    on_cuda = torch.cuda.is_available() and options.device != "cpu"
    name = torch.cuda.get_device_name() if on_cuda else f"cpu ({torch.get_num_threads()} threads)"
    return {"device": name, "torch": torch.__version__, "host": client_machine()}


def run_serve(doc: dict, target: Path, drafter: Path, options, deadline, save) -> None:
    import concurrent.futures
    import multiprocessing

    levels = level_prompts(target, options)
    warmup = random_prompts(target, options.warmup_requests or max(options.concurrency), options.input_len,
                            options.seed + 10**6)
    doc["serve"] = {key: getattr(options, key) for key in (
        "input_len", "output_len", "concurrency", "prompts_per_level", "min_prompts", "max_model_len",
        "kv_cache_memory", "warmup_tokens")}
    doc["serve"].update(max_num_seqs=max(options.concurrency), warmup_requests=len(warmup),
                        warmup_per_level=True,
                        transport=TRANSPORT, modes=[], skipped_modes=[])
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as client:
        for name in options.modes:
            if deadline is not None and time.time() > deadline:
                doc["serve"]["skipped_modes"].append(name)
                continue
            record = serve_mode(MODES[name], target, drafter, options, client, levels, warmup, deadline)
            release_device()
            record["memory_allocated_after"] = memory_allocated()
            doc["serve"]["modes"].append(record)
            save(plot_too=False)


def run(options: argparse.Namespace) -> dict:
    """Every part in the order given; the document written after each."""
    from bench.bench_serve_modes_admission import Pair, run_admission
    from bench.bench_serve_modes_report import write

    started = time.time()
    deadline = started + options.budget_s if options.budget_s is not None else None
    target, drafter, origin = checkpoints(options)
    release_device()  # writing the pair leaves cached blocks a GPU budget would count as in use
    doc = {"name": options.name,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "commit": options.commit or _git_commit(), "command": options.command_line,
           **device_facts(options), "budget_s": options.budget_s,
           "checkpoints": {"target": str(target), "drafter": str(drafter), **origin}}
    out = Path(options.out)

    def save(*, plot_too: bool) -> None:
        doc["elapsed_s"] = time.time() - started
        write(doc, out, plot_too=plot_too)

    for part in options.parts:
        if part == "serve":
            run_serve(doc, target, drafter, options, deadline, save)
        else:
            doc["admission"] = run_admission(Pair(target, drafter), options, deadline, release_device)
        save(plot_too=False)
    save(plot_too=True)
    print((out / f"{options.name}.md").read_text())
    return doc


def _git_commit() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    return commit or "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replot", help="redraw the markdown and PNG of this JSON, and do nothing else")
    p.add_argument("--target", help="target checkpoint, with --drafter (default: a random pair)")
    p.add_argument("--drafter", help="its DFlash drafter")
    p.add_argument("--geometry", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    p.add_argument("--checkpoints", default="/tmp/dflash-e2e-pair", help="where the random pair is written")
    p.add_argument("--parts", nargs="+", choices=["serve", "admission"], default=["serve", "admission"],
                   help="what to run, in this order")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prompts-per-level", type=int, default=2, help="requests per level: this x C ...")
    p.add_argument("--min-prompts", type=int, default=4, help="... and at least this many")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: the largest concurrency")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192, help="of the serving engines")
    p.add_argument("--kv-cache-memory", default=None, help="of the serving engines (default: the engine's)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: block_size - 1)")
    p.add_argument("--admission-memory", default="8GiB", help="the KV budget both storages get")
    p.add_argument("--admission-max-model-len", type=int, nargs="+", default=[32768, 8192])
    p.add_argument("--admission-max-num-seqs", type=int, default=256)
    p.add_argument("--admission-dense-max-num-seqs", type=int, default=None,
                   help="dense's max_num_seqs (default: its best by the plan)")
    p.add_argument("--admission-requests", type=int, default=128)
    p.add_argument("--admission-prompt-len", type=int, default=2048)
    p.add_argument("--admission-max-tokens", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="compute dtype (default: the engine's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--budget-s", type=float, default=None, help="start nothing past this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="serve_modes_h200")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser()
    options = p.parse_args(argv)
    if bool(options.target) != bool(options.drafter):
        p.error("--target and --drafter go together")
    for flag in ("input_len", "output_len", "prompts_per_level", "min_prompts", "warmup_tokens",
                 "admission_requests", "admission_prompt_len", "admission_max_tokens",
                 "admission_max_num_seqs"):
        if getattr(options, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be at least 1")
    if min(options.concurrency) < 1:
        p.error("--concurrency: every level must be at least 1")
    options.command_line = "python -m bench.bench_serve_modes " + " ".join(argv)
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    if options.replot:
        from bench.bench_serve_modes_report import replot

        replot(Path(options.replot))
        return 0
    run(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load an OpenAI-compatible server: latency percentiles, throughput and acceptance per rate or concurrency.

    python -m dflash_cli.bench.serve_load --url http://127.0.0.1:8000/v1 (--request-rate R [R ...]
        | --concurrency C [C ...]) [--model NAME] [--api-key-file F] [--num-prompts 64]
        [--prompts corpus|random] [--input-len N|MIN-MAX | --input-lens-file F]
        [--output-len N|MIN-MAX | --output-lens-file F] [--passes new [repeat|new ...]] [--cold]
        [--gap-threshold-ms 250] [--metrics-counter NAME ...] [--tokenizer-dir DIR] [--seed 0]
        [--no-stream] [--out DIR (default: the current directory) --name serve]
    (the same as `dflash bench serve ...`)

Any server that speaks /v1/completions works (`dflash serve`, vLLM, another build of this one), so two
servers can be compared on one workload. Each pass of each setting sends `--num-prompts` prompts as
token ids, each asking for exactly its output length (greedy, ignore_eos: a vLLM extension, so the
work per request is fixed and runs are comparable). Prompts are held-out windows of the corpus the demo
pair was trained on (the stdlib files it never saw, `training.corpus`), or random token ids; their
lengths, the passes (`new` prompts, or a `repeat` of the pass before) and the warm-up are planned up
front by `serve_workload`, all from --seed.

A request rate sends Poisson arrivals (seeded exponential gaps): an open loop, latency grows with load.
A concurrency level keeps that many requests in flight, each worker sending back to back: a closed loop.
Per request, from the SSE stream (`serve_request`): TTFT (first text), ITL (gaps between chunks with
text: one chunk carries every token a speculative step accepted), TPOT ((E2E - TTFT) / (output tokens -
1), the tokens from the final usage chunk) and E2E. Acceptance, and any --metrics-counter, comes from
the server's Prometheus counters (vLLM's `vllm:spec_decode_*`, so a vLLM server is read the same),
scraped before the first pass and after each. A `dflash serve` scrape holds every replica; behind a
load balancer that sends each scrape to one server, each is scraped several times and the largest
(latest) counter per replica label is kept.

This module runs the load; `dflash_cli.bench.serve_report` turns what it saw into numbers and files.
Heavy imports (httpx, tqdm, torch through training.corpus) stay inside functions, so `dflash --help`
can add these flags without loading them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cli.bench.serve_gaps import DEFAULT_GAP_THRESHOLD_MS
from dflash_cli.bench.serve_request import Endpoint, RequestResult, request_body, scrape, send_request
from dflash_cli.bench.serve_workload import (
    Prompt,
    RunPlan,
    add_workload_arguments,
    check_workload_args,
    plan_run,
    setting_label,
)

if TYPE_CHECKING:
    import httpx


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of a Poisson process of `rate` requests/s: the first at 0, then
    seeded exponential gaps of mean 1 / rate. rate inf: every request at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for index in range(count):
        if index and rate != float("inf"):
            now += rng.expovariate(rate)
        times.append(now)
    return times


Send = Callable[[dict], Awaitable[RequestResult]]


async def run_at_rate(send: Send, bodies: list[dict], rate: float, seed: int) -> list[RequestResult]:
    """Open loop: each body at its Poisson arrival time, whatever is still in flight."""
    start = time.perf_counter()

    async def one(at: float, body: dict) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await send(body)

    arrivals = poisson_arrivals(len(bodies), rate, seed)
    return list(await asyncio.gather(*(one(at, body) for at, body in zip(arrivals, bodies))))


async def run_at_concurrency(send: Send, bodies: list[dict], concurrency: int) -> list[RequestResult]:
    """Closed loop: `concurrency` workers, each sending the next body as soon as its last one finished."""
    results: list[RequestResult | None] = [None] * len(bodies)
    queue = iter(enumerate(bodies))  # shared: the event loop hands each body to exactly one worker

    async def worker() -> None:
        for index, body in queue:
            results[index] = await send(body)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return results


def corpus_prompts(tokenizer_dir: Path, count: int, input_len: int, seed: int,
                   corpus: list[str] | None = None, held_out_percent: float = 5.0) -> list[list[int]]:
    """Held-out windows of the training corpus (default: this Python's stdlib, whose held-out files the
    demo pair never trained on), `input_len` tokens each."""
    from tokenizers import Tokenizer

    from training.corpus import held_out_prompts, load_documents, split_documents

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    _, held = split_documents(load_documents(corpus), held_out_percent)
    return held_out_prompts(tokenizer, held, count, input_len, seed=seed)


def random_prompts(tokenizer_dir: Path, count: int, input_len: int, seed: int) -> list[list[int]]:
    """Seeded uniform token ids of the tokenizer's vocabulary, its special tokens left out."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    special = set(tokenizer.get_added_tokens_decoder())
    ids = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(ids, k=input_len) for _ in range(count)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags, shared by `python -m dflash_cli.bench.serve_load` and `dflash bench serve`."""
    parser.add_argument("--url", required=True, help="the API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="model name to ask for (default: the first of GET /models)")
    parser.add_argument("--api-key-file", help="a file holding the API key (sent as Bearer)")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--request-rate", type=float, nargs="+", metavar="R",
                      help="requests/s, Poisson arrivals; one setting per value ('inf': all at once)")
    load.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                      help="requests in flight; one setting per value")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per pass (default: 64)")
    parser.add_argument("--prompts", choices=["corpus", "random"], default="corpus",
                        help="held-out corpus windows (default) or random token ids")
    add_workload_arguments(parser)
    parser.add_argument("--tokenizer-dir", help="directory of tokenizer.json (default: the demo target)")
    parser.add_argument("--corpus", nargs="+", metavar="PATH",
                        help="corpus roots for --prompts corpus (default: this Python's stdlib)")
    parser.add_argument("--held-out-percent", type=float, default=5.0, help="the corpus split (default: 5.0)")
    parser.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals (default: 0)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream (default); --no-stream measures E2E only")
    parser.add_argument("--gap-threshold-ms", type=float, default=DEFAULT_GAP_THRESHOLD_MS,
                        help="count the gaps between tokens longer than this, per pass (default: 250)")
    parser.add_argument("--metrics-url", help="Prometheus text (default: /metrics beside the API root)")
    parser.add_argument("--metrics-scrapes", type=int, default=8,
                        help="scrapes before and after each pass, to see every replica (default: 8)")
    parser.add_argument("--metrics-counter", action="append", metavar="NAME",
                        help="a /metrics counter (its sample name, e.g. X_total) reported as what each pass "
                        "added, e.g. the server's kernel compilations; repeatable (default: none)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    parser.add_argument("--out", default=".", help="results directory (default: the current directory)")
    parser.add_argument("--name", default="serve", help="results file stem (default: serve)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def check_args(args: argparse.Namespace) -> None:
    """Values argparse cannot check, each a one-line ValueError naming its flag."""
    if not re.match(r"^https?://[^/]", args.url):
        raise ValueError(f"--url: expected http(s)://host:port/v1, got {args.url!r}")
    for flag, value, low in (("--num-prompts", args.num_prompts, 1),
                             ("--metrics-scrapes", args.metrics_scrapes, 0)):
        if value < low:
            raise ValueError(f"{flag}: must be at least {low}, got {value}")
    check_workload_args(args)
    if any(not rate > 0 for rate in args.request_rate or ()):
        raise ValueError(f"--request-rate: every rate must be > 0 (or inf), got {args.request_rate}")
    if any(level < 1 for level in args.concurrency or ()):
        raise ValueError(f"--concurrency: every level must be at least 1, got {args.concurrency}")
    if not args.gap_threshold_ms > 0:
        raise ValueError(f"--gap-threshold-ms: must be > 0, got {args.gap_threshold_ms}")
    for name in args.metrics_counter or ():
        if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
            raise ValueError(f"--metrics-counter: expected a Prometheus sample name, got {name!r}")
    if args.api_key_file and not Path(args.api_key_file).is_file():
        raise ValueError(f"--api-key-file: no file {args.api_key_file}")


async def resolve_model(client: httpx.AsyncClient, endpoint: Endpoint) -> Endpoint:
    """The endpoint with its model named: `--model`, else the first the server lists."""
    import dataclasses

    import httpx

    if endpoint.model:
        return endpoint
    try:
        response = await client.get(endpoint.url.rstrip("/") + "/models", headers=endpoint.headers)
        response.raise_for_status()
        return dataclasses.replace(endpoint, model=response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, LookupError) as error:
        raise ValueError(f"--url: cannot list the models at {endpoint.url} ({error}); "
                         "is the server up? (or give --model)") from None


async def run_pass(client: httpx.AsyncClient, endpoint: Endpoint, bodies: list[dict], mode: str,
                   value: float, args: argparse.Namespace, name: str) -> list[RequestResult]:
    """Every body of one pass at the setting's rate (the same seeded arrivals each pass) or concurrency."""
    from tqdm import tqdm

    bar = tqdm(total=len(bodies), desc=name, unit="req", file=sys.stderr, disable=not args.progress)

    async def send(body: dict) -> RequestResult:
        result = await send_request(client, endpoint, body)
        bar.update()
        return result

    if mode == "request_rate":
        results = await run_at_rate(send, bodies, value, args.seed)
    else:
        results = await run_at_concurrency(send, bodies, int(value))
    bar.close()
    return results


async def run_setting(client: httpx.AsyncClient, endpoint: Endpoint, bodies: list[dict], mode: str,
                      value: float, args: argparse.Namespace) -> dict:
    """One rate or concurrency level, one `new` pass of `bodies` (what bench/bench_serve_modes.py runs)."""
    return await run_passes(client, endpoint, mode, value, [("new", bodies)], args, time.perf_counter())


async def run_passes(client: httpx.AsyncClient, endpoint: Endpoint, mode: str, value: float,
                     passes: list[tuple[str, list[dict]]], args: argparse.Namespace, origin: float) -> dict:
    """One rate or concurrency level: its (kind, bodies) passes in order, /metrics scraped before the
    first and after each (so each pass has its own acceptance and counters), every request timed, each
    pass summarized and all of them pooled. `origin`: the run's start, the zero of the arrival times."""
    from dflash_cli.bench.serve_report import (
        acceptance_between,
        counter_deltas,
        summarize_pass,
        summarize_setting,
    )

    # callers other than the CLI (bench/bench_serve_modes.py) pass a Namespace of the older flags only
    names = getattr(args, "metrics_counter", None) or []
    threshold_s = getattr(args, "gap_threshold_ms", DEFAULT_GAP_THRESHOLD_MS) / 1e3
    first = before = await scrape(client, endpoint, args.metrics_scrapes)
    summaries, pooled, duration = [], [], 0.0
    for number, (kind, bodies) in enumerate(passes, 1):
        name = setting_label(mode, value) + (f" pass {number} {kind}" if len(passes) > 1 else "")
        started = time.perf_counter()
        results = await run_pass(client, endpoint, bodies, mode, value, args, name)
        ended = time.perf_counter()
        after = await scrape(client, endpoint, args.metrics_scrapes)
        summaries.append(summarize_pass(
            number, kind, results, started=started, ended=ended, origin=origin, threshold_s=threshold_s,
            accepted=acceptance_between(before, after, endpoint.model),
            counters=counter_deltas(before, after, names, endpoint.model)))
        pooled += results
        duration += ended - started
        before = after
    return summarize_setting(mode, value, pooled, duration, acceptance_between(first, before, endpoint.model),
                             summaries)


async def run_settings(client: httpx.AsyncClient, endpoint: Endpoint, plan: RunPlan,
                       args: argparse.Namespace) -> dict:
    """The warm-up request unless --cold (not counted; a refused one stops the run with its reason),
    then every setting in the order given, each with its passes."""
    endpoint = await resolve_model(client, endpoint)
    origin = time.perf_counter()

    def body(prompt: Prompt) -> dict:
        return request_body(endpoint.model, prompt.token_ids, prompt.max_tokens, args.stream)

    if plan.warmup is not None:
        warmup = await send_request(client, endpoint, body(plan.warmup))
        if not warmup.ok:
            raise ValueError(f"--url: the warm-up request to {endpoint.url} failed ({warmup.error})")
    settings = []
    for setting in plan.settings:
        passes = [(one.kind, [body(prompt) for prompt in one.prompts]) for one in setting.passes]
        settings.append(await run_passes(client, endpoint, setting.mode, setting.value, passes, args, origin))
    return {"url": endpoint.url, "model": endpoint.model, "settings": settings}


async def _bench(endpoint: Endpoint, plan: RunPlan, args: argparse.Namespace) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # a rate has no cap
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        return await run_settings(client, endpoint, plan, args)


def run(args: argparse.Namespace) -> int:
    """Check the flags, draw every prompt of the run, run every setting, write the results."""
    from dflash_cli.bench.serve_report import write_results
    from target_service.assembly.demo import demo_target_path

    check_args(args)
    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else demo_target_path()
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer-dir: no tokenizer.json in {tokenizer_dir}")
    if args.prompts == "corpus":
        source = functools.partial(corpus_prompts, tokenizer_dir, corpus=args.corpus,
                                   held_out_percent=args.held_out_percent)
    else:
        source = functools.partial(random_prompts, tokenizer_dir)
    plan = plan_run(args, source)
    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    endpoint = Endpoint(args.url, args.model or "", api_key, args.metrics_url)
    result = asyncio.run(_bench(endpoint, plan, args))
    write_results(result, args, str(tokenizer_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.command_line = "python -m dflash_cli.bench.serve_load " + " ".join(argv)
    try:
        return run(args)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())

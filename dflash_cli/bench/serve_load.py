"""Load an OpenAI-compatible server: latency percentiles, throughput and acceptance per rate or concurrency.

    python -m dflash_cli.bench.serve_load --url http://127.0.0.1:8000/v1 (--request-rate R [R ...]
        | --concurrency C [C ...]) [--model NAME] [--api-key-file F] [--num-prompts 64]
        [--prompts corpus|random] [--input-len 64] [--output-len 128] [--tokenizer-dir DIR] [--seed 0]
        [--no-stream] [--out DIR (default: the current directory) --name serve]
    (the same as `dflash bench serve ...`)

Any server that speaks /v1/completions works (`dflash serve`, vLLM, another build of this one), so two
servers can be compared on one workload. Every setting sends the same `--num-prompts` prompts as token
ids, each asking for exactly `--output-len` tokens (greedy, ignore_eos: a vLLM extension, so the work
per request is fixed and runs are comparable). Prompts are held-out windows of the corpus the demo pair
was trained on (the stdlib files it never saw, `training.corpus`), or random token ids.

A request rate sends Poisson arrivals (seeded exponential gaps): an open loop, latency grows with load.
A concurrency level keeps that many requests in flight, each worker sending back to back: a closed loop.
Per request, from the SSE stream: TTFT (first text), ITL (gaps between chunks with text: one chunk
carries every token a speculative step accepted), TPOT ((E2E - TTFT) / (output tokens - 1), the tokens
from the final usage chunk) and E2E. Acceptance comes from the server's Prometheus counters (vLLM's
`spec_decode` names), scraped before and after each setting: a scrape reaches one replica, so each is
scraped several times and the largest (latest) counter per replica label is kept.

This module talks to the server; `dflash_cli.bench.serve_report` turns what it saw into numbers and
files. Heavy imports (httpx, torch through training.corpus) stay inside functions, so `dflash --help`
can add these flags without loading them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

@dataclass(frozen=True)
class Endpoint:
    """Where requests go: `url` is the API root (`http://host:port/v1`); /metrics sits beside /v1."""

    url: str
    model: str = ""
    api_key: str | None = None
    metrics_url: str | None = None  # None: the server root's /metrics

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def metrics(self) -> str:
        return self.metrics_url or self.url.rstrip("/").removesuffix("/v1") + "/metrics"


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from the moment it was sent."""

    ok: bool = False
    error: str | None = None  # the HTTP status ("503"), a stream error or an exception's name
    ttft: float | None = None  # the first chunk with text (None without a stream)
    itl: list[float] = field(default_factory=list)  # gaps between chunks with text
    e2e: float = 0.0
    output_tokens: int = 0  # usage.completion_tokens, or chunks with text when the server sent no usage
    usage_reported: bool = False
    replica: str | None = None  # X-Dflash-Replica, where the server names one

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(model: str, prompt: list[int], output_len: int, stream: bool) -> dict:
    """Exactly `output_len` greedy tokens: ignore_eos makes every request the same amount of work."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, body: dict) -> RequestResult:
    """POST one completion and time it; every failure is recorded, none raised."""
    import httpx

    result = RequestResult()
    started = time.perf_counter()
    try:
        url = endpoint.url.rstrip("/") + "/completions"
        async with client.stream("POST", url, json=body, headers=endpoint.headers) as response:
            result.replica = response.headers.get("x-dflash-replica")
            if response.status_code != 200:
                await response.aread()
                result.error = str(response.status_code)
            elif body.get("stream"):
                await _read_stream(response, result, started)
            else:
                usage = json.loads(await response.aread()).get("usage") or {}
                result.output_tokens = usage.get("completion_tokens", 0)
                result.usage_reported = result.ok = "completion_tokens" in usage
                result.error = None if result.ok else "no usage"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = type(error).__name__
    if not result.e2e:
        result.e2e = time.perf_counter() - started
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, started: float) -> None:
    """Parse SSE `data:` lines up to [DONE]: text chunks give TTFT and ITL, the usage chunk the tokens."""
    last = None
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            result.e2e = time.perf_counter() - started
            result.ok = True
            break
        event = json.loads(data)
        if "error" in event:  # a refusal after the stream began
            result.error = f"stream {event['error'].get('code') or event['error'].get('type')}"
            return
        if event.get("usage"):
            result.output_tokens = event["usage"]["completion_tokens"]
            result.usage_reported = True
        if any(choice.get("text") for choice in event.get("choices") or ()):
            now = time.perf_counter()
            if last is None:
                result.ttft = now - started
            else:
                result.itl.append(now - last)
            last = now
            chunks += 1
    if not result.ok:
        result.error = "stream ended before [DONE]"
    elif not result.usage_reported:
        result.output_tokens = chunks


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


async def scrape(client: httpx.AsyncClient, endpoint: Endpoint, times: int) -> list[str]:
    """`times` scrapes of /metrics (a load balancer sends each to one replica); failed ones are dropped."""
    import httpx

    texts = []
    for _ in range(times):
        try:
            response = await client.get(endpoint.metrics, headers=endpoint.headers)
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            texts.append(response.text)
    return texts


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
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per setting (default: 64)")
    parser.add_argument("--prompts", choices=["corpus", "random"], default="corpus",
                        help="held-out corpus windows (default) or random token ids")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (default: 128)")
    parser.add_argument("--tokenizer-dir", help="directory of tokenizer.json (default: the demo target)")
    parser.add_argument("--corpus", nargs="+", metavar="PATH",
                        help="corpus roots for --prompts corpus (default: this Python's stdlib)")
    parser.add_argument("--held-out-percent", type=float, default=5.0, help="the corpus split (default: 5.0)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream (default); --no-stream measures E2E only")
    parser.add_argument("--metrics-url", help="Prometheus text (default: /metrics beside the API root)")
    parser.add_argument("--metrics-scrapes", type=int, default=8,
                        help="scrapes before and after each setting, to see every replica (default: 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    parser.add_argument("--out", default=".", help="results directory (default: the current directory)")
    parser.add_argument("--name", default="serve", help="results file stem (default: serve)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def check_args(args: argparse.Namespace) -> None:
    """Values argparse cannot check, each a one-line ValueError naming its flag."""
    if not re.match(r"^https?://[^/]", args.url):
        raise ValueError(f"--url: expected http(s)://host:port/v1, got {args.url!r}")
    for flag, value, low in (("--num-prompts", args.num_prompts, 1), ("--input-len", args.input_len, 1),
                             ("--output-len", args.output_len, 1),
                             ("--metrics-scrapes", args.metrics_scrapes, 0)):
        if value < low:
            raise ValueError(f"{flag}: must be at least {low}, got {value}")
    if any(not rate > 0 for rate in args.request_rate or ()):
        raise ValueError(f"--request-rate: every rate must be > 0 (or inf), got {args.request_rate}")
    if any(level < 1 for level in args.concurrency or ()):
        raise ValueError(f"--concurrency: every level must be at least 1, got {args.concurrency}")
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


async def run_setting(client: httpx.AsyncClient, endpoint: Endpoint, bodies: list[dict], mode: str,
                      value: float, args: argparse.Namespace) -> dict:
    """One rate or concurrency level: counters scraped around it, every request timed, summarized."""
    from tqdm import tqdm

    from dflash_cli.bench.serve_report import acceptance, latest_counters, summarize_setting

    before = latest_counters(await scrape(client, endpoint, args.metrics_scrapes), endpoint.model)
    bar = tqdm(total=len(bodies), desc=f"{mode} {value:g}", unit="req", file=sys.stderr,
               disable=not args.progress)

    async def send(body: dict) -> RequestResult:
        result = await send_request(client, endpoint, body)
        bar.update()
        return result

    started = time.perf_counter()
    if mode == "request_rate":
        results = await run_at_rate(send, bodies, value, args.seed)
    else:
        results = await run_at_concurrency(send, bodies, int(value))
    duration = time.perf_counter() - started
    bar.close()
    after = latest_counters(await scrape(client, endpoint, args.metrics_scrapes), endpoint.model)
    accepted = acceptance(before, after) if before and after else None
    return summarize_setting(mode, value, results, duration, accepted)


async def run_settings(client: httpx.AsyncClient, endpoint: Endpoint, prompts: list[list[int]],
                       args: argparse.Namespace) -> dict:
    """A warm-up request (not counted; a refused one stops the run with its reason), then every setting
    in the order given, all with the same prompts."""
    endpoint = await resolve_model(client, endpoint)
    bodies = [request_body(endpoint.model, prompt, args.output_len, args.stream) for prompt in prompts]
    warmup = await send_request(client, endpoint, bodies[0])
    if not warmup.ok:
        raise ValueError(f"--url: the warm-up request to {endpoint.url} failed ({warmup.error})")
    modes = [("request_rate", rate) for rate in args.request_rate or ()]
    modes += [("concurrency", level) for level in args.concurrency or ()]
    settings = [await run_setting(client, endpoint, bodies, mode, value, args) for mode, value in modes]
    return {"url": endpoint.url, "model": endpoint.model, "settings": settings}


async def _bench(endpoint: Endpoint, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # a rate has no cap
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        return await run_settings(client, endpoint, prompts, args)


def run(args: argparse.Namespace) -> int:
    """Check the flags, make the prompts, run every setting, write the results."""
    from dflash_cli.bench.serve_report import write_results
    from target_service.assembly.demo import demo_target_path

    check_args(args)
    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else demo_target_path()
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer-dir: no tokenizer.json in {tokenizer_dir}")
    if args.prompts == "corpus":
        prompts = corpus_prompts(tokenizer_dir, args.num_prompts, args.input_len, args.seed, args.corpus,
                                 args.held_out_percent)
    else:
        prompts = random_prompts(tokenizer_dir, args.num_prompts, args.input_len, args.seed)
    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    endpoint = Endpoint(args.url, args.model or "", api_key, args.metrics_url)
    result = asyncio.run(_bench(endpoint, prompts, args))
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

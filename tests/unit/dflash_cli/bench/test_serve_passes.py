"""Passes of `dflash bench serve` and what each reports: the gaps between tokens (serve_gaps), the pass
summary, the counters a pass added, the per-pass markdown table and the JSON, and a whole run against an
in-process fake server that streams.

Oracles: numpy over gaps computed here from the arrival times, hand-computed gaps and counters, and a
fake server that stalls once on a prompt it has not seen (as a server filling its prefix cache or
compiling for a new shape would) and counts those stalls on /metrics: a `repeat` pass must see no stall
and a counter delta of 0, a `new` pass one stall per request.
"""

import argparse
import asyncio
import importlib.util
import itertools
import json
import random
import secrets

import httpx
import numpy as np
import pytest

from dflash_cli.bench.serve_gaps import gap_points, gap_stats, timeline
from dflash_cli.bench.serve_load import add_arguments, run_settings
from dflash_cli.bench.serve_report import counter_deltas, markdown, pass_rows, summarize_pass, write_results
from dflash_cli.bench.serve_request import Endpoint, RequestResult
from dflash_cli.bench.serve_workload import plan_run

URL = "http://fake.test/v1"


def cli(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--url", URL, "--no-progress", "--metrics-scrapes", "1", *flags])


def test_gap_stats_by_hand():
    results = [RequestResult(ok=True, sent_at=0.9, chunk_at=[1.0, 1.1, 1.5, 1.55]),  # gaps .1 .4 .05
               RequestResult(ok=True, sent_at=1.9, chunk_at=[2.0, 2.3]),  # gap .3
               RequestResult(ok=True, sent_at=3.0, chunk_at=[3.2]),  # one chunk: no gap
               RequestResult(ok=False, sent_at=0.0, chunk_at=[0.0, 5.0], error="503")]  # failed: left out
    assert gap_stats(results, 0.25) == {"longest_gap_s": pytest.approx(0.4), "gaps_over_threshold": 2}
    assert gap_stats(results, 0.35)["gaps_over_threshold"] == 1
    assert gap_stats(results[2:], 0.25) == {"longest_gap_s": None, "gaps_over_threshold": 0}
    recorded = timeline(results, origin=0.5)
    assert recorded == {"sent_at_s": [0.4, 1.4, 2.5],
                        "chunk_at_s": [[0.5, 0.6, 1.0, 1.05], [1.5, 1.8], [2.7]]}
    times, gaps = gap_points(recorded)
    assert times == [0.6, 1.0, 1.05, 1.8] and gaps == pytest.approx([100, 400, 50, 300])


def test_a_pass_summary_matches_numpy_over_fresh_random_arrivals():
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    origin, started = 100.0, 100.0 + rng.uniform(0, 5)
    results, arrivals = [], []
    for _ in range(int(rng.integers(5, 40))):
        sent = started + rng.uniform(0, 2)
        chunks = sent + np.cumsum(rng.exponential(0.05, int(rng.integers(1, 30))))
        arrivals.append(chunks)
        results.append(RequestResult(ok=True, sent_at=sent, chunk_at=list(chunks), e2e=chunks[-1] - sent,
                                     output_tokens=len(chunks), usage_reported=True))
    ended = max(a[-1] for a in arrivals)
    threshold = rng.uniform(0.02, 0.2)
    one = summarize_pass(2, "repeat", results, started=started, ended=ended, origin=origin,
                         threshold_s=threshold, accepted=None, counters={"x_total": 3.0})
    gaps = np.concatenate([np.diff(a) for a in arrivals])
    ttfts = [a[0] - r.sent_at for a, r in zip(arrivals, results)]
    note = f"seed {seed}"
    assert (one["pass"], one["kind"], one["metrics_counters"]) == (2, "repeat", {"x_total": 3.0})
    assert one["started_s"] == pytest.approx(started - origin)
    assert one["gaps_over_threshold"] == int((gaps > threshold).sum()), note
    if gaps.size:
        assert one["longest_gap_s"] == pytest.approx(gaps.max()), note
        for q in (50, 99):
            assert one["itl_s"][f"p{q}"] == pytest.approx(np.percentile(gaps, q)), note
    for q in (50, 99):
        assert one["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q)), note
    tokens = sum(len(a) for a in arrivals)
    assert one["output_throughput"] == pytest.approx(tokens / (ended - started))
    assert one["request_throughput"] == pytest.approx(len(results) / (ended - started))
    recorded = one["timeline"]["chunk_at_s"]
    assert [len(c) for c in recorded] == [len(a) for a in arrivals]
    assert np.allclose(np.concatenate(recorded), np.concatenate(arrivals) - origin, atol=5e-5)


def metrics(replica: str, value: float, model: str = "m", extra: str = "") -> str:
    return f'x_total{{model_name="{model}",replica="{replica}"{extra}}} {value}\n'


def test_counter_deltas_sum_replicas_seen_twice_and_count_a_new_counter_from_zero():
    up = 'process_up{replica="%s"} 1\n'
    before = [metrics("0", 5) + up % "1", metrics("0", 4)]  # a stale scrape of 0; replica 1 lacks x yet
    after = [metrics("0", 9) + metrics("0", 2, extra=',kernel="b"'), metrics("1", 7), metrics("2", 50),
             metrics("0", 99, model="other")]
    # replica 0: 9 + 2 (two series) - 5; replica 1: 7 - 0 (x appeared); replica 2: seen only after
    assert counter_deltas(before, after, ["x_total", "y_total"], "m") == {"x_total": 13.0, "y_total": None}
    assert counter_deltas(before, after, [], "m") == {}


def pass_summary(number: int, kind: str, **values) -> dict:
    base = {"pass": number, "kind": kind, "requests": 4, "completed": 4, "failures": {},
            "ttft_s": {"p50": 0.0123, "p99": 0.456}, "itl_s": {"p50": 0.0071, "p99": 0.25},
            "longest_gap_s": 1.2345, "gaps_over_threshold": 7, "request_throughput": 3.14159,
            "output_throughput": 401.26, "acceptance": {"mean_acceptance_length": 2.5},
            "metrics_counters": {"c_total": 12.0}}
    return {**base, **values}


def test_the_pass_table_has_a_row_per_pass_with_the_issues_columns():
    doc = {"gap_threshold_ms": 100.0, "metrics_counters": ["c_total"], "settings": [
        {"mode": "concurrency", "value": 8, "passes": [
            pass_summary(1, "new"),
            pass_summary(2, "repeat", completed=3, failures={"503": 1}, longest_gap_s=None, itl_s=None,
                         acceptance=None, metrics_counters={"c_total": None}, gaps_over_threshold=0)]}]}
    assert pass_rows(doc) == [
        "| setting | pass | done | failed | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| longest gap ms | gaps > 100 ms | req/s | output tok/s | acceptance length | c_total added |",
        "| --- " * 14 + "|",
        "| concurrency 8 | 1 new | 4/4 | 0 | 12.3 | 456.0 | 7.1 | 250.0 | 1234.5 | 7 | 3.14 | 401.3 | 2.50 "
        "| 12 |",
        "| concurrency 8 | 2 repeat | 3/4 | 1 x 503 | 12.3 | 456.0 | - | - | - | 0 | 3.14 | 401.3 | - | - |",
    ]


class FakeServer:
    """Streams `max_tokens` chunks `gap_s` apart; the first time it sees a prompt, the gap before the
    second chunk is `stall_s` and fake:misses_total goes up by one. /metrics also counts a draft per
    token and two accepted (an acceptance length of 3)."""

    def __init__(self, stall_s: float = 0.12, gap_s: float = 0.002):
        self.stall_s, self.gap_s = stall_s, gap_s
        self.bodies: list[dict] = []
        self.seen: set[tuple[int, ...]] = set()
        self.misses = self.drafts = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path == "/metrics":
            labels = '{model_name="fake",replica="0"}'
            return httpx.Response(200, text=f"fake:misses_total{labels} {self.misses}\n"
                                  f"vllm:spec_decode_num_drafts_total{labels} {self.drafts}\n"
                                  f"vllm:spec_decode_num_accepted_tokens_total{labels} {2 * self.drafts}\n")
        body = json.loads(request.content)
        self.bodies.append(body)
        miss = tuple(body["prompt"]) not in self.seen
        self.seen.add(tuple(body["prompt"]))
        return httpx.Response(200, content=self.stream(body["max_tokens"], miss))

    async def stream(self, tokens: int, miss: bool):
        for index in range(tokens):
            if index:
                await asyncio.sleep(self.stall_s if miss and index == 1 else self.gap_s)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n".encode()
        self.misses += miss
        self.drafts += tokens
        yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': tokens}})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def fake_source(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1 << 40) for _ in range(length)] for _ in range(count)]


def bench(server: FakeServer, args: argparse.Namespace):
    plan = plan_run(args, fake_source)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server.handle)) as client:
            return await run_settings(client, Endpoint(URL), plan, args)

    return plan, asyncio.run(main())


def key(body: dict) -> tuple:
    return tuple(body["prompt"]), body["max_tokens"]


@pytest.mark.parametrize("cold", [False, True])
def test_passes_against_a_streaming_server_repeat_exactly_and_report_each_pass(cold, tmp_path):
    flags = ["--concurrency", "3", "--num-prompts", "6", "--input-len", "2-5", "--output-len", "3-5",
             "--passes", "new", "repeat", "new", "--gap-threshold-ms", "60", "--metrics-counter",
             "fake:misses_total", "--seed", str(secrets.randbits(16)), "--out", str(tmp_path)]
    args = cli(*flags, *(["--cold"] if cold else []))
    server = FakeServer()
    plan, result = bench(server, args)

    # what the server received: the warm-up unless cold, then each pass's prompts, passes in order
    warmups = [] if cold else [key(server.bodies[0])]
    sent = server.bodies[len(warmups):]
    assert len(sent) == 18
    first, repeat, fresh = (sorted(key(b) for b in sent[i:i + 6]) for i in (0, 6, 12))
    assert first == sorted((tuple(p.token_ids), p.max_tokens) for p in plan.settings[0].passes[0].prompts)
    assert repeat == first  # exactly the previous pass's prompts, lengths and output lengths
    assert not {p for p, _ in fresh} & {p for p, _ in first + warmups}
    assert all(2 <= len(p) <= 5 and 3 <= n <= 5 for p, n in fresh + first)
    if not cold:
        assert key(server.bodies[0]) == (tuple(plan.warmup.token_ids), plan.warmup.max_tokens)
        assert key(server.bodies[0]) not in first

    setting = result["settings"][0]
    assert setting["requests"] == setting["completed"] == 18 and setting["failures"] == {}
    passes = setting["passes"]
    assert [(p["pass"], p["kind"], p["completed"]) for p in passes] == [(1, "new", 6), (2, "repeat", 6),
                                                                         (3, "new", 6)]
    assert [p["gaps_over_threshold"] for p in passes] == [6, 0, 6]  # one stall per unseen prompt
    assert [p["metrics_counters"] for p in passes] == [{"fake:misses_total": n} for n in (6.0, 0.0, 6.0)]
    assert passes[0]["longest_gap_s"] >= 0.12 and passes[1]["longest_gap_s"] < 0.06
    for index, one in enumerate(passes):
        assert one["acceptance"]["mean_acceptance_length"] == pytest.approx(3.0)
        assert one["acceptance"]["drafts"] == one["output_tokens"]
        requests = setting["per_request"][6 * index:6 * (index + 1)]  # pooled in pass order
        assert [len(c) for c in one["timeline"]["chunk_at_s"]] == [r["output_tokens"] for r in requests]
        _, gaps = gap_points(one["timeline"])
        assert max(gaps) == pytest.approx(one["longest_gap_s"] * 1e3, abs=0.2)
    assert passes[0]["started_s"] >= 0
    for earlier, later in itertools.pairwise(passes):
        assert later["started_s"] >= earlier["started_s"] + earlier["duration_s"]
    assert setting["duration_s"] == pytest.approx(sum(p["duration_s"] for p in passes))
    assert setting["output_tokens"] == sum(p["output_tokens"] for p in passes)

    args.command_line = "dflash bench serve ..."
    doc = write_results(result, args, "tok")
    text = (tmp_path / "serve.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(doc))
    stored = json.loads(text)
    assert (stored["passes"], stored["cold"], stored["gap_threshold_ms"], stored["metrics_counters"]) == (
        ["new", "repeat", "new"], cold, 60.0, ["fake:misses_total"])
    assert (stored["input_len"], stored["output_len"]) == ("2-5 (uniform)", "3-5 (uniform)")
    assert set(stored["settings"][0]["passes"][0]) >= {
        "pass", "kind", "started_s", "ttft_s", "itl_s", "tpot_s", "e2e_s", "longest_gap_s",
        "gaps_over_threshold", "request_throughput", "output_throughput", "failures", "acceptance",
        "metrics_counters", "timeline"}
    lines = {line.strip().rstrip(",") for line in text.splitlines()}
    for chunks in stored["settings"][0]["passes"][0]["timeline"]["chunk_at_s"]:  # one line per request
        assert json.dumps(chunks) in lines
    rows = [line for line in markdown(doc).splitlines() if line.startswith("| concurrency 3 | ")]
    assert [row.split(" | ")[1] for row in rows[1:]] == ["1 new", "2 repeat", "3 new"]
    assert [row.split(" | ")[9] for row in rows[1:]] == ["6", "0", "6"]  # the gaps > 60 ms column
    assert (tmp_path / "serve_gaps.png").exists() == (importlib.util.find_spec("matplotlib") is not None)

"""The serving load generator (dflash_cli.bench.serve_load) and its arithmetic (serve_report).

Oracles: a real Replica of the demo pair behind the real ASGI app (every request counted, each with
exactly the tokens asked for, latencies ordered, the acceptance equal to the engine's own counters),
hand-made SSE streams for what another server may send, numpy for the percentiles, the exponential's
mean for the Poisson schedule, and hand-made /metrics texts for the acceptance.
"""

import argparse
import asyncio
import json
import statistics
import time

import httpx
import numpy as np
import pytest

from dflash_cli.bench.serve_load import (
    add_arguments,
    corpus_prompts,
    poisson_arrivals,
    random_prompts,
    run_at_concurrency,
    run_at_rate,
    run_setting,
    run_settings,
)
from dflash_cli.bench.serve_report import (
    acceptance,
    latest_counters,
    markdown,
    percentile,
    summarize,
    summarize_setting,
    write_results,
)
from dflash_cli.bench.serve_request import Endpoint, RequestResult, request_body, send_request
from dflash_cli.bench.serve_workload import plan_run
from target_service.assembly.demo import demo_target_path
from target_service.serving.api import ServerHolder, create_app
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

URL = "http://dflash.test/v1"
OUTPUT_LEN = 12


@pytest.fixture(scope="module")
def served():
    replica = Replica(ServeArgs(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
                                max_num_seqs=4, admin_port=None))
    holder = ServerHolder()
    holder.install(replica.server, replica.metrics)
    holder.rank = 0
    yield replica, create_app(holder)
    replica.close()


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dflash.test")


def options(**overrides) -> argparse.Namespace:
    values = dict(metrics_scrapes=2, progress=False, seed=0, output_len=OUTPUT_LEN, stream=True,
                  request_rate=None, concurrency=None)
    return argparse.Namespace(**{**values, **overrides})


def test_every_request_against_a_real_replica_is_measured_and_its_acceptance_is_the_engines(served):
    replica, app = served
    prompts = random_prompts(demo_target_path(), 6, 16, seed=3)
    bodies = [request_body("dflash-demo", p, OUTPUT_LEN, True) for p in prompts]
    stats = replica.assembly.engine.stats
    drafts, accepted = stats.num_drafts, stats.num_accepted_tokens

    async def main():
        async with asgi_client(app) as client:
            endpoint = Endpoint(URL, "dflash-demo")
            return await run_setting(client, endpoint, bodies, "concurrency", 2, options())

    setting = asyncio.run(main())
    assert setting["requests"] == setting["completed"] == 6 and setting["failures"] == {}
    assert [r["output_tokens"] for r in setting["per_request"]] == [OUTPUT_LEN] * 6
    assert sorted(r["prompt_tokens"] for r in setting["per_request"]) == sorted(map(len, prompts))
    assert setting["output_tokens"] == 6 * OUTPUT_LEN and setting["usage_missing"] == 0
    for request in setting["per_request"]:
        assert 0 < request["ttft_s"] <= request["e2e_s"] and request["tpot_s"] > 0
        assert 1 <= request["chunks"] <= OUTPUT_LEN  # a chunk carries one step's accepted tokens
    assert setting["replicas_seen"] == {"0": 6}
    added = setting["acceptance"]
    assert added["replicas"] == ["0"] and added["unmatched_replicas"] == []
    assert added["drafts"] == stats.num_drafts - drafts > 0
    assert added["accepted"] == stats.num_accepted_tokens - accepted
    assert added["mean_acceptance_length"] == pytest.approx(1 + added["accepted"] / added["drafts"])


def cli_options(*flags: str) -> argparse.Namespace:
    """Every flag of `dflash bench serve` at its default, then `flags`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--url", URL, "--metrics-scrapes", "2", "--no-progress", *flags])


def test_run_settings_names_the_model_warms_up_and_runs_each_rate(served, tmp_path):
    _, app = served
    args = cli_options("--request-rate", "inf", "50", "--no-stream", "--num-prompts", "4", "--input-len", "8",
                       "--output-len", str(OUTPUT_LEN), "--seed", "1", "--prompts", "random",
                       "--name", "serve_test", "--out", str(tmp_path))
    plan = plan_run(args, lambda count, length, seed: random_prompts(demo_target_path(), count, length, seed))

    async def main():
        async with asgi_client(app) as client:
            return await run_settings(client, Endpoint(URL), plan, args)

    result = asyncio.run(main())
    assert result["model"] == "dflash-demo"  # from GET /v1/models
    assert [(s["mode"], s["value"]) for s in result["settings"]] == [("request_rate", float("inf")),
                                                                     ("request_rate", 50.0)]
    for setting in result["settings"]:
        assert setting["completed"] == 4 and setting["output_tokens"] == 4 * OUTPUT_LEN
        assert setting["ttft_s"] is None and setting["e2e_s"]["count"] == 4  # no stream: E2E only
    doc = write_results(result, args, "tok")
    assert json.loads((tmp_path / "serve_test.json").read_text())["settings"] == json.loads(
        json.dumps(doc["settings"]))
    assert (tmp_path / "serve_test.png").stat().st_size > 0
    assert not (tmp_path / "serve_test_gaps.png").exists()  # no stream, no gaps to draw
    table = [line for line in (tmp_path / "serve_test.md").read_text().splitlines() if line.startswith("| ")]
    # two tables (settings, passes), each a header, a rule and one row per setting (one pass each)
    assert len(table) == 2 * (2 + 2) and table[2].startswith("| rate inf | 4/4 | 0 |")
    assert table[6].startswith("| rate inf | 1 new | 4/4 | 0 | - | - | - | - | - | 0 |")


def test_corpus_prompts_are_held_out_windows_of_the_asked_length():
    from tokenizers import Tokenizer

    from training.corpus import load_documents, split_documents

    prompts = corpus_prompts(demo_target_path(), 5, 32, seed=7)
    assert prompts == corpus_prompts(demo_target_path(), 5, 32, seed=7)  # seeded
    assert [len(p) for p in prompts] == [32] * 5
    tokenizer = Tokenizer.from_file(str(demo_target_path() / "tokenizer.json"))
    _, held = split_documents(load_documents(), 5.0)
    for prompt in prompts:
        text = tokenizer.decode(prompt)
        assert any(text in d.text for d in held)


def sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def text_chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def send_to(status: int, body: bytes, stream: bool = True) -> RequestResult:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def main():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, Endpoint(URL, "m"), request_body("m", [1, 2], 4, stream))

    return asyncio.run(main())


def test_a_stream_counts_tokens_from_usage_and_chunks_with_text_only():
    body = sse(text_chunk("a"), text_chunk(""), text_chunk("bc"), text_chunk("", "length"),
               {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}})
    result = send_to(200, body)
    assert result.ok and result.error is None and result.usage_reported
    assert result.output_tokens == 4 and len(result.itl) == 1  # two chunks with text: one gap
    assert 0 < result.ttft <= result.e2e
    assert result.tpot == pytest.approx((result.e2e - result.ttft) / 3)


def test_another_servers_stream_without_usage_counts_its_text_chunks():
    result = send_to(200, sse(text_chunk("a"), text_chunk("b"), text_chunk("c")))
    assert result.ok and not result.usage_reported and result.output_tokens == 3


@pytest.mark.parametrize("status, body, error", [
    (503, b'{"error": {"message": "busy"}}', "503"),
    (200, sse(text_chunk("a"), {"error": {"code": "service_unavailable"}}, done=False),
     "stream service_unavailable"),
    (200, sse(text_chunk("a"), done=False), "stream ended before [DONE]"),
])
def test_every_failure_is_recorded_with_its_reason(status, body, error):
    result = send_to(status, body)
    assert not result.ok and result.error == error


def test_no_stream_reads_the_tokens_from_the_response_usage():
    result = send_to(200, json.dumps({"choices": [], "usage": {"completion_tokens": 4}}).encode(), False)
    assert result.ok and result.output_tokens == 4 and result.ttft is None and result.tpot is None


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5, 1, 4, 2, 3], list(np.random.default_rng(0)
                                    .exponential(1.0, 101)), list(np.random.default_rng(1).normal(0, 1, 64))])
def test_percentiles_match_numpy_and_the_mean_matches_statistics(values):
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    summary = summarize(values)
    assert summary["mean"] == pytest.approx(statistics.fmean(values))
    assert summary["p50"] == pytest.approx(statistics.median(values)) and summary["count"] == len(values)
    assert summarize([]) is None


def test_poisson_arrivals_gap_on_average_one_over_the_rate():
    arrivals = poisson_arrivals(20001, 4.0, seed=5)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.03)  # exponential: std equals the mean
    assert arrivals == poisson_arrivals(20001, 4.0, seed=5) != poisson_arrivals(20001, 4.0, seed=6)
    assert poisson_arrivals(5, float("inf"), seed=0) == [0.0] * 5


def test_a_rate_sends_each_request_at_its_arrival_whatever_is_in_flight():
    sent: list[float] = []

    async def main():
        start = time.perf_counter()

        async def send(body):
            sent.append(time.perf_counter() - start)
            await asyncio.sleep(0.3)  # longer than the gaps: an open loop does not wait
            return RequestResult(ok=True)

        return await run_at_rate(send, [{}] * 8, 40.0, seed=2)

    results = asyncio.run(main())
    assert len(results) == 8
    assert sent == pytest.approx(poisson_arrivals(8, 40.0, seed=2), abs=0.05)


@pytest.mark.parametrize("concurrency, count", [(1, 5), (3, 10), (8, 4)])
def test_a_concurrency_level_keeps_that_many_in_flight_and_answers_in_order(concurrency, count):
    in_flight, peak = 0, 0

    async def send(body):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01 * (body["i"] % 3 + 1))
        in_flight -= 1
        return RequestResult(ok=True, output_tokens=body["i"])

    results = asyncio.run(run_at_concurrency(send, [{"i": i} for i in range(count)], concurrency))
    assert [r.output_tokens for r in results] == list(range(count))
    assert peak == min(concurrency, count)


def metrics_text(replica: str, drafts: int, draft_tokens: int, accepted: int, model="dflash-demo") -> str:
    labels = f'model_name="{model}",replica="{replica}"'
    return "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Speculative steps that drafted",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}.0",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}.0",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}.0",
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 99.0',
    ]) + "\n"


def test_acceptance_takes_each_replicas_latest_counters_over_the_scrapes():
    before = latest_counters([metrics_text("0", 10, 150, 40), metrics_text("1", 4, 60, 20),
                              metrics_text("0", 9, 135, 30)], "dflash-demo")  # a stale scrape: ignored
    assert before == {"0": {"drafts": 10, "draft_tokens": 150, "accepted": 40},
                      "1": {"drafts": 4, "draft_tokens": 60, "accepted": 20}}
    after = latest_counters([metrics_text("1", 14, 210, 65), metrics_text("0", 30, 450, 100),
                             metrics_text("0", 1000, 1, 1, model="other")], "dflash-demo")
    added = acceptance(before, after)
    # replica 0 adds 20 drafts, 300 draft tokens, 60 accepted; replica 1 adds 10, 150, 45
    assert (added["drafts"], added["draft_tokens"], added["accepted"]) == (30, 450, 105)
    assert added["mean_acceptance_length"] == pytest.approx(1 + 105 / 30)
    assert added["replicas"] == ["0", "1"] and added["unmatched_replicas"] == []


def test_a_replica_seen_on_one_side_only_is_left_out_and_named():
    added = acceptance(latest_counters([metrics_text("0", 10, 150, 40)]),
                       latest_counters([metrics_text("0", 12, 180, 50), metrics_text("1", 99, 9, 9)]))
    assert (added["drafts"], added["accepted"]) == (2, 10) and added["unmatched_replicas"] == ["1"]
    assert acceptance({"0": {"drafts": 3}}, {"0": {"drafts": 3}})["mean_acceptance_length"] is None


def test_a_settings_summary_counts_failures_by_reason_and_throughput_over_its_wall_time():
    done = dict(ok=True, output_tokens=5, usage_reported=True, sent_at=10.0)
    results = [RequestResult(chunk_at=[10.1, 10.12, 10.16], e2e=0.5, **done),  # TTFT 0.1, ITL 0.02, 0.04
               RequestResult(chunk_at=[10.3, 10.36], e2e=0.7, **done),  # TTFT 0.3, ITL 0.06
               RequestResult(error="503", e2e=0.01), RequestResult(error="503", e2e=0.01),
               RequestResult(error="ReadTimeout", e2e=9.0)]
    setting = summarize_setting("concurrency", 2, results, 2.0, None)
    assert setting["failures"] == {"503": 2, "ReadTimeout": 1} and setting["completed"] == 2
    assert setting["request_throughput"] == 1.0 and setting["output_throughput"] == 5.0
    assert setting["itl_s"]["mean"] == pytest.approx(0.04) and setting["itl_s"]["count"] == 3
    assert setting["tpot_s"]["mean"] == pytest.approx(((0.5 - 0.1) / 4 + (0.7 - 0.3) / 4) / 2)
    assert setting["e2e_s"]["p50"] == pytest.approx(0.6)  # failed requests' times are left out
    doc = {"name": "n", "date": "d", "commit": "c", "command": "x", "url": URL, "model": "m", "client": "c",
           "num_prompts": 5, "prompts": "random", "input_len": 8, "output_len": 5, "stream": True, "seed": 0,
           "passes": ["new"], "cold": False, "gap_threshold_ms": 250.0, "metrics_counters": [],
           "settings": [setting]}
    assert "| concurrency 2 | 2/5 | 2 x 503, 1 x ReadTimeout | 1.00 | 5.0 | 200.0 / 200.0 / 298.0 |" \
        in markdown(doc)

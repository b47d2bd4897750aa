"""`dflash serve` for real: a subprocess starting its own Ray (loopback) and two Serve replicas of the
demo pair, driven over HTTP with the `openai` client. One server for the whole module (starting Ray,
Serve and two models takes ~20 s on two cores); each test protects one promise of the server."""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from promtool import check_metrics
from serve_process import MODEL, PROMPT, Server, assert_completion_and_stream_equal, offline_completion

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def server(ray_machine):
    started = Server()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def expected():
    return offline_completion()


def test_ready_line_names_the_url_and_a_curl_example(server):
    ready = next(line for line in server.lines if line.startswith("dflash serve: ready at"))
    assert f"http://127.0.0.1:{server.port}/v1" in ready and "curl" in ready and "dflash-demo" in ready


def test_completions_and_streams_equal_the_offline_llm(server, expected):
    api = server.client()
    assert_completion_and_stream_equal(api, expected)


def test_requests_spread_over_both_replicas(server):
    ranks = set()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(12):
            reply = http.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2})
            assert reply.status_code == 200
            ranks.add(reply.headers["x-dflash-replica"])
    assert ranks == {"0", "1"}


def test_admin_grpc_answers_per_replica_and_a_dropped_stream_frees_its_pages(server):
    admins = [server.admin(rank) for rank in (0, 1)]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            held = sum(admin.stats().num_used_blocks for admin in admins)
        # the client left mid-stream: its request is aborted and its pages freed at once
    deadline = time.monotonic() + 20
    while sum(admin.stats().num_used_blocks for admin in admins) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held > 0 and sum(admin.stats().num_used_blocks for admin in admins) == 0
    assert all(admin.stats().num_seqs == 0 for admin in admins)


def scrape(server) -> dict:
    """One scrape of /metrics: (sample name, frozen labels) -> value."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        reply = http.get("/metrics")
    assert reply.status_code == 200
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(reply.text) for sample in family.samples}


def per_replica(table: dict, name: str, **labels) -> dict[str, float]:
    """replica label -> the value of sample `name` (with `labels`) in one scrape."""
    return {dict(key)["replica"]: v for (sample, key), v in table.items()
            if sample == name and labels.items() <= dict(key).items()}


def aborted_requests(server) -> float:
    """Aborted requests over both replicas: one scrape holds them both."""
    aborted = per_replica(scrape(server), "vllm:request_success_total", finished_reason="abort")
    assert set(aborted) == {"0", "1"}
    return sum(aborted.values())


def test_a_client_that_gives_up_on_a_whole_response_cancels_it_and_frees_its_pages(server):
    admins = [server.admin(rank) for rank in (0, 1)]
    aborted = aborted_requests(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.5)) as http, \
            pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)  # the client hangs up after half a second
    deadline = time.monotonic() + 20
    while sum(admin.stats().num_used_blocks for admin in admins) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(admin.stats().num_used_blocks for admin in admins) == 0
    assert aborted_requests(server) == aborted + 1  # cancelled, not run to its 400 tokens


def test_one_scrape_holds_every_replica_and_their_counters_add_up_to_what_ran(server):
    """Greedy requests one at a time (each alone in its replica, as the offline LLM runs it): summed
    over replica, the scrape's spec-decode counters grow by the offline LLM's per-request counts, its
    token counters by the responses' usage; each replica's prefix-cache queries equal its pool's own
    (its admin gRPC port); the exposition passes promtool."""
    from target_service.engine.sampling_params import SamplingParams
    from target_service.llm import LLM

    prompts = [PROMPT + "".join(random.choices("abcdefgh_ ", k=random.randint(1, 12))) for _ in range(5)]
    lengths = [random.randint(4, 24) for _ in prompts]
    llm = LLM(**MODEL)
    try:
        offline = [llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                   for p, n in zip(prompts, lengths)]
    finally:
        llm.close()
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:prompt_tokens_total",
             "vllm:generation_tokens_total")
    before = scrape(server)
    usage = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for prompt, n in zip(prompts, lengths):
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200
            usage.append(reply.json()["usage"])
        text = http.get("/metrics").text
    after = {(s.name, frozenset(s.labels.items())): s.value
             for family in text_string_to_metric_families(text) for s in family.samples}
    added = {name: sum(per_replica(after, name).values()) - sum(per_replica(before, name).values())
             for name in names}
    assert all(set(per_replica(after, name)) == {"0", "1"} for name in names)
    stats = [output.spec_decode for output in offline]
    assert added["vllm:spec_decode_num_drafts_total"] == sum(s.num_drafts for s in stats) > 0
    assert added["vllm:spec_decode_num_draft_tokens_total"] == sum(s.num_draft_tokens for s in stats)
    assert added["vllm:spec_decode_num_accepted_tokens_total"] == sum(s.num_accepted_tokens for s in stats)
    assert added["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usage)
    assert added["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usage) == sum(lengths)
    queries = per_replica(after, "vllm:prefix_cache_queries_total")
    assert queries == {str(rank): server.admin(rank).stats().prefix_cache_queries for rank in (0, 1)}
    check_metrics(text)


def test_sigterm_drains_in_flight_requests_then_exits(server):
    result = {}

    def long_request():
        with httpx.Client(base_url=server.url, timeout=120) as http:
            body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
            reply = http.post("/v1/completions", json=body)
            result["status"], result["body"] = reply.status_code, reply.json()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(1.0)  # the request is running
    server.process.send_signal(signal.SIGTERM)
    worker.join(120)
    assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 300
    assert server.process.wait(90) == 0

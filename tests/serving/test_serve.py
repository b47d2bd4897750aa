"""`dflash serve` for real: a subprocess starting its own Ray (loopback) and two Serve replicas of the
demo pair, driven over HTTP with the `openai` client. One server for the whole module (starting Ray,
Serve and two models takes ~20 s on two cores); each test protects one promise of the server."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from serve_process import PROMPT, Server, assert_completion_and_stream_equal, offline_completion

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


def aborted_requests(server) -> float:
    """Aborted requests over both replicas (a scrape reaches one replica: scrape until both seen)."""
    latest = {}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for _ in range(40):
            text, rank = (reply := http.get("/metrics")).text, reply.headers["x-dflash-replica"]
            latest[rank] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                               if line.startswith("dflash:request_success_total{")
                               and 'reason="abort"' in line)
            if len(latest) == 2:
                break
    return sum(latest.values())


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


def test_metrics_move_as_requests_run(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(4):
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        texts = [http.get("/metrics").text for _ in range(8)]  # a scrape reaches one replica
    drafted = [line for text in texts for line in text.splitlines()
               if line.startswith("dflash:spec_decode_num_drafts_total{")]
    assert drafted and max(float(line.rsplit(" ", 1)[1]) for line in drafted) > 0
    assert any("dflash:request_success_total" in text for text in texts)


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

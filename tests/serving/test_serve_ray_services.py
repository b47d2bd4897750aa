"""`dflash serve --services ray`: each replica drives the pool, drafter and target as Ray actors of its
own, behind the same HTTP contract. One real server (subprocess, its own Ray on loopback, one
replica) for the module; the offline in-process `LLM` is the reference."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from serve_process import MODEL, PROMPT, Server, assert_completion_and_stream_equal, offline_completion

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def server(ray_machine):
    started = Server("--services", "ray", "--per-request-spec-decode-metrics", "detailed", replicas=1)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def expected():
    return offline_completion()


COUNTED = ("vllm:spec_decode_num_drafts_total", "vllm:iteration_tokens_total_count",
           "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count")


def so_far(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "{")) for name in COUNTED}


def test_completions_and_streams_through_the_actors_equal_the_offline_llm(server, expected):
    api = server.client()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = so_far(http)
        assert_completion_and_stream_equal(api, expected)
        after = so_far(http)
    # the target actor's counters reach /metrics, and so does when it first scheduled each request
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after["vllm:iteration_tokens_total_count"] > before["vllm:iteration_tokens_total_count"]
    for phase in ("queue", "prefill"):
        name = f"vllm:request_{phase}_time_seconds_count"
        assert after[name] == before[name] + 2  # the whole completion and the stream


def test_a_responses_spec_decode_metrics_are_the_offline_engines_step_for_step(server):
    """The flag reaches the replica through `dflash serve` and Ray Serve, the per-step level reaches the
    target actor with the request, and its counters come back: a greedy request's steps equal those of
    the offline in-process engine."""
    from target_service.engine.sampling_params import SamplingParams
    from target_service.llm import LLM

    llm = LLM(**MODEL)
    try:
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, spec_decode_per_step=True)
        offline = llm.generate([PROMPT], params)[0].spec_decode
    finally:
        llm.close()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        stats = http.post("/v1/completions", json=body).json()["metrics"]["speculative_decoding"]
    assert stats["per_step_accepted"] == offline.per_step_accepted and offline.num_drafts > 0
    assert stats["per_step_drafted"] == offline.per_step_drafted
    assert stats["acceptance_histogram"] == offline.acceptance_histogram
    assert stats["num_spec_tokens"] == offline.num_spec_tokens > 0


def test_a_bad_request_is_refused_by_the_target_and_changes_nothing(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 4})
        message = reply.json()["error"]["message"]
        assert reply.status_code == 400, message
        assert message.startswith("prompt token ids [1000000000] are outside the vocabulary"), message
    assert server.admin(0).stats().num_seqs == 0


def test_the_admin_port_is_the_pool_actors_and_a_dropped_stream_frees_its_pages(server):
    admin = server.admin(0)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            held = admin.stats().num_used_blocks
        # the client left mid-stream: the stream's Ray call is cancelled, the target aborts the request
    deadline = time.monotonic() + 20
    while admin.stats().num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    usage = admin.stats()
    assert held > 0 and usage.num_used_blocks == 0 and usage.num_seqs == 0


def test_a_dead_target_fails_its_requests_with_503_and_the_restarted_one_serves(server, expected):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        replies = []
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        worker = threading.Thread(target=lambda: replies.append(http.post("/v1/completions", json=body)))
        worker.start()
        admin = server.admin(0)
        deadline = time.monotonic() + 30
        while not admin.stats().num_seqs and time.monotonic() < deadline:
            time.sleep(0.05)
        target_pids = subprocess.run(["pgrep", "-f", "ray::TargetService"], capture_output=True,
                                     text=True).stdout.split()
        assert len(target_pids) == 1, target_pids
        os.kill(int(target_pids[0]), signal.SIGKILL)
        worker.join(120)
        failed = replies[0]
        assert failed.status_code == 503 and "target service died" in failed.json()["error"]["message"]
        reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected.text
    deadline = time.monotonic() + 20  # the restarted target released what the dead one held
    while admin.stats().num_seqs and time.monotonic() < deadline:
        time.sleep(0.1)
    assert admin.stats().num_used_blocks == 0


def test_sigterm_stops_the_server_and_its_actors(server):
    server.process.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0
    assert any(line.startswith("dflash serve: stopping;") for line in server.lines)
    assert server.lines[-1].startswith("dflash serve: stopped")

"""`dflash serve` stopping under a request that outlives its drain (issue 30, item 5): once the drain
time is up (or at a second signal) the stream gets an error event and [DONE]; every request sent
while it stops is answered 503 until the port closes, never a 404; the exit status is 0. (A request
that finishes within the drain is test_serve.py's.)"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_process import MODEL, PROMPT, Server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_machine")]
# As long as the context allows: sampled, so it runs for seconds on two cores.
LONG = {"prompt": PROMPT, "max_tokens": MODEL["max_model_len"] - 64, "temperature": 1.0, "ignore_eos": True,
        "stream": True}
EXIT_S = 90


class LongStream:
    """One stream far longer than any drain here, read on its own thread."""

    def __init__(self, server: Server):
        self.events, self.started = [], threading.Event()
        self.thread = threading.Thread(target=self._read, args=(server.url,), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream never began"

    def _read(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=LONG) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.started.set()

    def ending(self) -> list:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the stream never ended"
        return self.events[-2:]


def statuses_until_closed(server: Server) -> list[int]:
    """Send a request every 0.1 s while the server stops; their statuses until the port refuses."""
    statuses = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while server.process.poll() is None:
            try:
                reply = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            except httpx.TransportError:
                break
            statuses.append(reply.status_code)
            time.sleep(0.1)
    return statuses


def test_a_stream_past_the_drain_gets_an_error_event_and_done_and_the_exit_is_clean():
    server = Server("--drain-timeout", "2", replicas=1)
    try:
        stream = LongStream(server)
        server.process.send_signal(signal.SIGTERM)
        statuses = statuses_until_closed(server)
        error, done = stream.ending()
        assert server.wait(EXIT_S) == 0
    finally:
        server.stop()
    assert done == "[DONE]" and error["error"]["code"] == "service_unavailable", error
    assert "drain time (2 s)" in error["error"]["message"]
    assert 503 in statuses and set(statuses) <= {200, 503}, statuses  # 200: before the drain began
    assert any(line.startswith("dflash serve: stopped") for line in server.lines)


def test_a_second_signal_stops_at_once():
    server = Server("--drain-timeout", "600", replicas=1)
    try:
        stream = LongStream(server)
        server.process.send_signal(signal.SIGINT)
        time.sleep(1.0)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        error, done = stream.ending()
        assert server.wait(EXIT_S) == 0
        took = time.monotonic() - signalled
    finally:
        server.stop()
    assert done == "[DONE]" and "stop at once" in error["error"]["message"], error
    assert took < 30, f"{took:.0f} s from the second signal to the exit"

"""Replica faults in the foreground (issue 30, item 8): `ReplicaWatch` says a replica lost, with Serve's
reason and the log's place, and the set whole again, once each; `watch_replicas` keeps looking past a
look that fails; and a real `dflash serve` whose replica is SIGKILLed says both lines, then serves."""

import os
import random
import signal
import threading
import time

import pytest
from serve_process import PROMPT, Server

from bench.soak_watch import replica_pids
from target_service.serving.replica_watch import ReplicaCounts, ReplicaWatch, watch_replicas

RECOVERY_S = 120


def test_a_lost_replica_is_said_once_with_the_reason_and_the_log_and_so_is_the_recovery():
    wanted = random.randint(2, 8)
    watch = ReplicaWatch(wanted, "/tmp/session/logs/serve/")
    assert watch.observe(ReplicaCounts(wanted, wanted)) is None
    lost = watch.observe(ReplicaCounts(wanted - 2, wanted, "A replica's health check failed.\nmore"))
    assert lost.startswith(f"dflash serve: 2 replica(s) stopped, {wanted - 2} of {wanted} running")
    assert "(A replica's health check failed.)" in lost and lost.endswith("/tmp/session/logs/serve/")
    assert watch.observe(ReplicaCounts(wanted - 2, wanted, "still")) is None
    assert watch.observe(ReplicaCounts(wanted - 1, wanted)) is None  # one of two back: not whole yet
    whole = watch.observe(ReplicaCounts(wanted, wanted))
    assert whole == f"dflash serve: all {wanted} replica(s) running again"
    assert watch.observe(ReplicaCounts(wanted, wanted)) is None


def test_a_loss_without_a_message_says_so():
    watch = ReplicaWatch(1, "logs")
    assert "(Ray Serve gave no reason)" in watch.observe(ReplicaCounts(0, 1))


def test_the_thread_says_each_change_and_looks_again_after_a_failed_look():
    looks = iter([RuntimeError("busy"), ReplicaCounts(0, 1, "died"), None])  # None: not deployed
    said, stop, done = [], threading.Event(), threading.Event()

    def look():
        item = next(looks, ReplicaCounts(1, 1))
        if isinstance(item, Exception):
            raise item
        return item

    def say(line):
        said.append(line)
        if len(said) == 2:
            done.set()

    watch_replicas(look, ReplicaWatch(1, "logs"), stop, say, poll_s=0.01)
    assert done.wait(5)
    stop.set()
    assert "0 of 1 running (died)" in said[0] and said[1] == "dflash serve: all 1 replica(s) running again"


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("ray_machine")
def test_a_killed_replica_is_said_in_the_foreground_and_its_replacement_serves():
    server = Server(replicas=1)
    try:
        (pid,) = replica_pids(server.process.pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + RECOVERY_S
        while not any("running again" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.5)
        said = [line for line in server.lines if line.startswith("dflash serve: ")]
        answer = server.client().completions.create(model="dflash-demo", prompt=PROMPT, max_tokens=4)
    finally:
        server.stop()
    assert any("1 replica(s) stopped, 0 of 1 running" in line and "logs/serve/" in line
               for line in said), said
    assert any(line.startswith("dflash serve: all 1 replica(s) running again") for line in said), said
    assert answer.usage.completion_tokens == 4

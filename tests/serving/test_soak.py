"""The soak, bounded (issue 30): 16 streaming clients for 35 s against a real `dflash serve` (the demo
pair on CPU, one replica, its own Ray), a third of them leaving at random points, some with short
deadlines, some sending the poisons of bench.soak_poisons; then nothing may be left behind.

`bench.soak.run_soak` runs once for the module (~80 s on two cores, the server's start included);
each test reads one promise off its result. The latency and memory trends need minutes to mean
anything: the ten-minute run with 64 clients is `python -m bench.soak`, its result in bench/results/.
"""

from __future__ import annotations

import pytest
from serve_process import Server

from bench.soak import SoakServer, leftover_shm, run_soak
from bench.soak_clients import SoakLoad, role_of
from bench.soak_poisons import POISONS
from bench.soak_watch import process_tree

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

CLIENTS, DURATION_S = 16, 35.0  # bounded: the suite has to fit CI's 20 minutes on 2 cores
# more poisons than the long run's, so each is sent; deadlines short enough that some pass
LOAD = SoakLoad(poison_rate=0.25, timeout_s=(0.3, 3.0))
FD_SLACK = 8  # of ~300 in the tree: a Ray worker may open a log or a connection of its own meanwhile


@pytest.fixture(scope="module")
def soak(ray_machine):
    server = Server("--max-num-seqs", "8", "--kv-cache-memory", "32MiB", replicas=1)
    tree = process_tree(server.process.pid)
    try:
        target = SoakServer(server.url, server.process.pid, (f"127.0.0.1:{server.admin_port}",))
        doc = run_soak(target, clients=CLIENTS, duration_s=DURATION_S, load=LOAD, fd_slack=FD_SLACK)
    finally:
        server.stop()
    doc["left_after_stop"] = leftover_shm(tree)
    return doc


def test_the_soak_ran_its_mix_of_clients(soak):
    kinds = soak["requests"]["by_kind"]
    assert soak["settings"]["clients"] == CLIENTS and {role_of(i) for i in range(CLIENTS)} == {
        "complete", "disconnect", "timeout"}
    assert kinds["complete"] >= 20 and kinds["disconnect"] >= 20 and kinds["poison"] >= len(POISONS)
    assert soak["requests"]["disconnected"] >= 10 and soak["requests"]["timed_out"] >= 1


def test_every_stream_not_left_early_completed_well_formed_with_done(soak):
    records = soak["records"]
    assert all(r["outcome"] == "completed" for r in records if r["kind"] == "complete"), soak["faults"]
    assert all(r["outcome"] in ("completed", "disconnected", "timed_out") for r in records
               if r["kind"] in ("disconnect", "timeout")), soak["faults"]
    assert soak["faults"] == {"count": 0, "first": []}


def test_every_poison_gets_its_expected_answer(soak):
    answered = soak["requests"]["poisons"]
    assert set(answered) == {poison.name for poison in POISONS}
    for poison in POISONS:
        assert answered[poison.name]["statuses"] == {str(poison.status): answered[poison.name]["sent"]}
        assert answered[poison.name]["wrong"] == 0


def test_no_page_or_sequence_in_use_after(soak):
    assert [(p["num_used_blocks"], p["num_seqs"]) for p in soak["pages_after"]] == [(0, 0)]


def test_no_dev_shm_entry_leaked(soak):
    assert soak["dev_shm"]["new_of_server"] == [] and soak["left_after_stop"] == []


def test_file_descriptors_back_within_a_small_slack(soak):
    fds = soak["fds"]
    assert fds["tree_after"] - fds["tree_before"] <= FD_SLACK, fds
    assert fds["replicas_after"] == fds["replicas_before"] or all(
        fds["replicas_after"][pid] - fds["replicas_before"][pid] <= 2 for pid in fds["replicas_before"]), fds


def test_health_was_200_throughout(soak):
    server = soak["server"]
    assert server["health_samples"] >= DURATION_S / 2 and server["health_not_200"] == []


def test_the_engine_never_restarted(soak):
    server = soak["server"]
    assert len(server["replica_pids_before"]) == 1
    assert server["replica_pids_after"] == server["replica_pids_before"]
    assert server["replica_pids_changed"] == []

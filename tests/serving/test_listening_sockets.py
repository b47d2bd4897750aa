"""What a real `dflash serve` listens on (issue 30, "closed by default"): every listening TCP socket of
its process tree (the command, the local Ray it starts, Ray Serve's proxy and controller, the replica
with its admin gRPC server) is on loopback, and that Ray runs with token authentication: its own
token, in a file only this user can read, and no Ray RPC answered without it.

One server for the module, with one replica (~20 s to start on two cores)."""

from __future__ import annotations

import re
import stat
import time
from pathlib import Path

import grpc
import pytest
from listening_sockets import environment, listening_sockets, process_tree
from serve_process import Server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"),
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")]

# One harmless RPC of each Ray gRPC service: the GCS, a raylet's node and object managers, a worker,
# a Serve replica.
RAY_PROBES = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetResourceLoad",
              "/ray.rpc.ObjectManagerService/FreeObjects", "/ray.rpc.CoreWorkerService/NumPendingTasks",
              "/ray.serve.ASGIService/HandleRequest")
REFUSED = grpc.StatusCode.UNAUTHENTICATED
PROBE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def server(ray_machine):
    started = Server(replicas=1)
    yield started
    started.stop()


# The processes the tests below read a socket of. Ready is when the HTTP port answers; on a loaded
# machine Serve's controller can still be between starting and listening then (seen once in a full
# run), so the snapshot waits for each of them, bounded.
NEEDED = ("gcs_server", "raylet", "ray::ServeController")
SNAPSHOT_WAIT_S = 30.0


@pytest.fixture(scope="module")
def sockets(server):
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while True:
        found = listening_sockets(process_tree(server.process.pid))
        if {s.process for s in found} >= set(NEEDED) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _one(sockets, process: str):
    return next(s for s in sockets if s.process == process)


def _call(port: int, method: str, token: str | None = None) -> grpc.StatusCode:
    """`method` with an empty request on 127.0.0.1:`port`, with `token` as Ray's bearer token."""
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
        try:
            call(b"", timeout=PROBE_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def _cluster_token(sockets) -> Path:
    """The token file the server's Ray was given: from the GCS's environment, as its parent set it."""
    env = environment(_one(sockets, "gcs_server").pid)
    assert env["RAY_AUTH_MODE"] == "token"
    assert "RAY_AUTH_TOKEN" not in env  # the file alone, not a copy in every process's environment
    return Path(env["RAY_AUTH_TOKEN_PATH"])


def test_our_own_listeners_are_on_loopback(server, sockets):
    ours = {s.port: s for s in sockets if s.port in (server.port, server.admin_port)}
    assert set(ours) == {server.port, server.admin_port}  # the lister sees them: it cannot pass empty
    assert all(s.on_loopback for s in ours.values()), ours


def test_every_other_listener_is_on_loopback_or_is_ray_refusing_callers_without_the_token(sockets):
    assert {"gcs_server", "raylet", "ray::ProxyActor", "ray::ServeController"} <= {s.process for s in sockets}
    outside = [s for s in sockets if not s.on_loopback]
    # Ray 2.60's Serve replicas bind their inter-deployment gRPC server to [::] whatever the node IP
    assert all(s.process.startswith("ray::") for s in outside), outside
    for listener in outside:
        answers = {_call(listener.port, method) for method in RAY_PROBES}
        assert REFUSED in answers and grpc.StatusCode.OK not in answers, (listener, answers)


def test_the_servers_ray_has_its_own_token_readable_by_this_user_alone(sockets):
    token_file = _cluster_token(sockets)
    assert re.fullmatch(r"[0-9a-f]{64}", token_file.read_text())  # 256 random bits
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    assert token_file != Path.home() / ".ray" / "auth_token"  # not the user's shared default token


def test_no_ray_rpc_is_answered_without_the_token(sockets):
    token = _cluster_token(sockets).read_text()
    gcs = _one(sockets, "gcs_server")
    assert _call(gcs.port, RAY_PROBES[0], token) == grpc.StatusCode.OK  # the probe itself works
    # the front door refuses a missing and a wrong token; so do a raylet and the Serve controller
    assert _call(gcs.port, RAY_PROBES[0]) == REFUSED
    assert _call(gcs.port, RAY_PROBES[0], "0" * 64) == REFUSED
    raylet_ports = {s.port for s in sockets if s.process == "raylet"}
    assert REFUSED in {_call(port, RAY_PROBES[1]) for port in raylet_ports}
    controller = _one(sockets, "ray::ServeController")
    assert _call(controller.port, RAY_PROBES[3]) == REFUSED
    # and no listener of the tree answers any of Ray's RPCs without it
    answered = [(s, method) for s in sockets for method in RAY_PROBES
                if _call(s.port, method) == grpc.StatusCode.OK]
    assert answered == []

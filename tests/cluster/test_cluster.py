"""`dflash serve` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, every
node on loopback: a head with no CPUs, and two worker nodes with one CPU and one `dflash_gpu`, a
custom resource standing in for a GPU). The command runs as a subprocess, as a user would run it; the
test process starts and kills nodes but never becomes a Ray driver. Placement is read from the
X-Dflash-Node header every response carries.

Each cluster test has its own cluster (~4 s) and tells one story from start to end, so it holds
wherever xdist sends it (~25 s each on two cores).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from free_ports import free_port

from target_service.serving.deploy import replica_bundle, replica_deployment
from target_service.serving.serve_args import ServeArgs

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_machine")]
READY_TIMEOUT_S = 150
RESCHEDULE_TIMEOUT_S = 90
PROMPT = "def parse_args(argv):\n    parser = "
LOOPBACK = "127.0.0.1"
WORKER_NODE = dict(num_cpus=1, resources={"dflash_gpu": 1}, node_ip_address=LOOPBACK)
# Someone else's application on the same Serve, pinned to the head: it must outlive `dflash serve`.
OTHER_APP = """
import sys
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR")
serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})

@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"dflash_head": 0.01}})
class Other:
    async def __call__(self, request):
        return "other"

serve.run(Other.bind(), name="other", route_prefix="/other")
"""


def driver_env(ray_address: str | None = None) -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return env


def serve_command(port: int, *address: str) -> list[str]:
    return [sys.executable, "-m", "dflash_cli.main", "serve", *address, "--port", str(port),
            "--replicas", "2", "--replica-resources", '{"dflash_gpu": 1}', "--num-cpus-per-replica", "0.5",
            "--admin-port", "-1", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--max-model-len", "1024", "--max-num-seqs", "4"]


class LocalCluster:
    """Three Ray nodes on loopback; worker nodes can be removed and added back."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        self.client_port = free_port()
        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args=dict(
            num_cpus=0, resources={"dflash_head": 1}, node_ip_address=LOOPBACK, include_dashboard=False,
            ray_client_server_port=self.client_port))
        self.address = self.cluster.address  # the GCS, host:port
        self.client_address = f"ray://{LOOPBACK}:{self.client_port}"
        self.workers = []
        for _ in range(2):
            self.add_worker()

    def add_worker(self) -> None:
        self.workers.append(self.cluster.add_node(**WORKER_NODE))

    def remove_worker(self, node_id: str) -> None:
        node = next(node for node in self.workers if node.node_id == node_id)
        self.workers.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def worker_ids(self) -> set[str]:
        return {node.node_id for node in self.workers}


class DFlashServe:
    """`dflash serve` as a subprocess, ready once it prints its ready line, whose URL it then uses."""

    def __init__(self, *address: str, env: dict[str, str]):
        self.port = free_port()
        self.url = ""
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.process = subprocess.Popen(serve_command(self.port, *address), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(READY_TIMEOUT_S):
            self.stop()
            raise AssertionError("dflash serve never became ready:\n" + "".join(self.lines[-30:]))

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("dflash serve: ready at "):
                self.url = line.split()[4].removesuffix("/v1")
                self.ready.set()

    def answers(self, requests: int) -> tuple[list[int], list[str], set[str]]:
        """`requests` short completions, one after another: their statuses, and the nodes and ranks
        that answered them."""
        statuses, nodes, ranks = [], [], set()
        with httpx.Client(base_url=self.url, timeout=60) as http:
            for _ in range(requests):
                reply = http.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2})
                statuses.append(reply.status_code)
                if reply.status_code == 200:
                    nodes.append(reply.headers["x-dflash-node"])
                    ranks.add(reply.headers["x-dflash-replica"])
        return statuses, nodes, ranks

    def stop(self) -> int:
        """SIGTERM (drain, then delete the application); the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(90)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


@pytest.fixture
def cluster():
    started = None
    try:
        started = LocalCluster()
        yield started
    finally:
        if started is not None:
            started.cluster.shutdown()  # every node's processes; never `ray stop`


@contextlib.contextmanager
def dflash_serve(*address: str, env: dict[str, str]) -> Iterator[DFlashServe]:
    started = DFlashServe(*address, env=env)
    try:
        yield started
    finally:
        started.stop()


def deploy_other_app(cluster: LocalCluster) -> str:
    """Start Serve on `cluster` with someone else's settings and application; returns its URL."""
    port = free_port()
    other = subprocess.run([sys.executable, "-c", OTHER_APP, cluster.address, str(port)], env=driver_env(),
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    return f"http://{LOOPBACK}:{port}"


def test_replica_bundle_holds_the_cpus_gpus_and_custom_resources_of_one_replica():
    args = ServeArgs(replicas=2, num_cpus_per_replica=0.5, num_gpus_per_replica=1,
                     replica_resources='{"dflash_gpu": 1}')
    assert replica_bundle(args) == {"CPU": 0.5, "GPU": 1.0, "dflash_gpu": 1.0}
    assert replica_bundle(ServeArgs(num_cpus_per_replica=2)) == {"CPU": 2.0}  # no GPU key without GPUs
    options = replica_deployment(args).ray_actor_options  # the replica actor takes its whole bundle
    assert (options["num_cpus"], options["num_gpus"], options["resources"]) == (0.5, 1.0, {"dflash_gpu": 1.0})


def test_with_ray_services_a_replicas_gpu_goes_to_its_three_service_bundles():
    from target_service.serving.deploy import replica_bundles

    args = ServeArgs(services="ray", num_cpus_per_replica=0.5, num_gpus_per_replica=1,
                     replica_resources='{"dflash_gpu": 1}')
    bundles = replica_bundles(args)
    assert bundles[0] == {"CPU": 0.5, "dflash_gpu": 1.0}  # the replica actor: no GPU of its own
    assert bundles[1:] == [{"CPU": 0.25, "GPU": 0.33}] * 3  # pool, drafter, target share the GPU
    assert sum(bundle.get("GPU", 0) for bundle in bundles) <= args.num_gpus_per_replica
    assert replica_deployment(args).ray_actor_options["num_gpus"] == 0
    cpu = replica_bundles(ServeArgs(services="ray", num_cpus_per_replica=0.5))
    assert cpu == [{"CPU": 0.5}] + [{"CPU": 0.25}] * 3
    assert replica_bundles(ServeArgs(num_cpus_per_replica=0.5)) == [{"CPU": 0.5}]  # in process: one


@pytest.mark.parametrize(("flag", "expected"), [
    ('{"dflash_gpu": 1', "--replica-resources: not JSON"),
    ('{"GPU": 1}', "--replica-resources: GPU has its own flag (--num-gpus-per-replica)"),
    ('{"dflash_gpu": 0}', "--replica-resources: dflash_gpu needs a positive amount"),
])
def test_bad_replica_resources_are_one_line_naming_the_flag(flag, expected, capsys, monkeypatch):
    import target_service.serving.deploy as deploy
    from dflash_cli import main as cli

    monkeypatch.setattr(deploy, "start_ray", lambda settings: pytest.fail("Ray was started"))
    assert cli.main(["serve", "--replica-resources", flag]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"dflash serve: error: {expected}"), err


@pytest.mark.slow
def test_replicas_land_one_per_worker_node_and_outlive_the_loss_of_one(cluster):
    with dflash_serve("--address", cluster.address, env=driver_env()) as server:
        assert server.url == f"http://{LOOPBACK}:{server.port}"  # Serve is ours: our --port
        # one replica per dflash_gpu: one on each worker node, none on the head; requests reach both
        statuses, nodes, ranks = server.answers(12)
        assert statuses == [200] * 12 and ranks == {"0", "1"} and set(nodes) == cluster.worker_ids()

        # lose the node of an in-flight stream: the proxy cuts it (an incomplete body, no [DONE])
        body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        events, error = [], None
        with httpx.Client(base_url=server.url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            events.append(next(line for line in lines if line.startswith("data:")))
            doomed = response.headers["x-dflash-node"]
            cluster.remove_worker(doomed)
            try:
                events.extend(line for line in lines if line.startswith("data:"))
            except httpx.HTTPError as raised:
                error = raised
        assert isinstance(error, httpx.RemoteProtocolError), (events[-1], error)
        assert "data: [DONE]" not in events

        # straight after the loss, the other replica answers every request
        statuses, nodes, _ = server.answers(10)
        assert statuses == [200] * 10 and set(nodes) == cluster.worker_ids() and doomed not in nodes

        # a node with a dflash_gpu joins: Serve's replacement replica, pending until now, starts there
        cluster.add_worker()
        deadline = time.monotonic() + RESCHEDULE_TIMEOUT_S
        nodes = set()
        while nodes != cluster.worker_ids() and time.monotonic() < deadline:
            statuses, answered, _ = server.answers(4)
            assert statuses == [200] * 4
            nodes |= set(answered)
        assert nodes == cluster.worker_ids()
        assert server.stop() == 0


@pytest.mark.slow
def test_on_a_shared_cluster_only_this_application_is_deployed_and_deleted(cluster):
    other_url = deploy_other_app(cluster)  # Serve already runs there, with someone else's port
    # RAY_ADDRESS in Ray Client form (ray://), no --address
    with dflash_serve(env=driver_env(ray_address=cluster.client_address)) as server:
        assert server.url == other_url  # the running proxy, not our --port: the ready line says so
        statuses, nodes, ranks = server.answers(12)
        assert statuses == [200] * 12 and ranks == {"0", "1"} and set(nodes) == cluster.worker_ids()

        # a second dflash serve on this cluster is refused by name before it deploys; ours serves on
        second = subprocess.run(serve_command(free_port(), "--address", cluster.address), env=driver_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "already runs an application named 'dflash'" in second.stderr
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/v1/models").status_code == 200
            assert server.stop() == 0
            assert http.get("/v1/models").status_code == 404  # our application is gone ...
            other = http.get("/other")  # ... and only ours: Serve still runs the other one
            assert (other.status_code, other.text) == (200, "other")


SERVICES_DRIVER = """
import json, sys
from ray.util.placement_group import placement_group_table
from target_service.assembly.demo import resolve_pair
from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.ray_services import RayServices
from target_service.engine.sampling_params import SamplingParams

target, drafter = resolve_pair(None, None)
args = EngineArgs(target=target, drafter=drafter, device="cpu", dtype="float32", kv_cache_memory="16MiB",
                  max_model_len=512, max_num_seqs=4)
services = RayServices(args, address=sys.argv[1]).start()
try:
    prompt = json.loads(sys.argv[2])
    out = services.generate([prompt], [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])[0]
    nodes = placement_group_table(services.placement)["bundles_to_node_id"]
    print(json.dumps({"tokens": out.token_ids, "nodes": sorted(nodes.values()), "pids": services.pids()}))
finally:
    services.close()
"""


@pytest.mark.slow
def test_ray_services_join_a_cluster_and_pack_their_three_actors_on_one_node(cluster):
    """The trio on a running cluster (`address`): one STRICT_PACK placement group, its three bundles
    on one worker node (the head has no CPUs for them), and the in-process engine's tokens."""
    import json

    from target_service.engine.sampling_params import SamplingParams
    from target_service.llm import LLM

    prompt = list(range(40, 72))
    driver = subprocess.run([sys.executable, "-c", SERVICES_DRIVER, cluster.address, json.dumps(prompt)],
                            env=driver_env(), capture_output=True, text=True, timeout=240)
    assert driver.returncode == 0, driver.stderr[-3000:]
    result = json.loads(driver.stdout.strip().splitlines()[-1])
    assert len(result["nodes"]) == 3 and len(set(result["nodes"])) == 1
    assert result["nodes"][0] in cluster.worker_ids()
    assert len(set(result["pids"].values())) == 3
    llm = LLM(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=512, max_num_seqs=4)
    expected = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    llm.close()
    assert result["tokens"] == expected[0].outputs[0].token_ids

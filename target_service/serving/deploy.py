"""`dflash serve` as a Ray Serve application: Ray Serve routes HTTP to replicas, checks their health
and drains them on shutdown; each replica is one `Replica` (the model, its engine, the OpenAI server,
the admin port).

The routes are this module's `APP`, built over the named holder `HOLDER`; a replica's constructor
installs its server there. Ray Serve ships each replica a pickled copy of the app, closures included;
a named holder unpickles to that process's own holder of the same name (`api.holder_named`), so the copied
routes and the constructor meet.

Placement: each replica gets its own placement group of one bundle (its CPUs, GPUs and custom
`replica_resources`), STRICT_PACK, so a replica never straddles nodes, and the actors it will start
(the Ray services) land in its group. One replica per GPU is the GPU count's doing (or a custom
resource standing in for a GPU on a CPU cluster), not a per-node cap. Every response names the Ray
node that served it (X-Dflash-Node).

Ray on one machine binds loopback only (docs/architecture.md section 8): with no `--address` (and
no RAY_ADDRESS) a local Ray is started for this command alone and stopped with it. On a cluster it
joins, the command deploys its application (refusing when one of that name already runs there),
and on leaving deletes only that application: Serve and the cluster go on, the driver disconnects.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import ray
from ray import serve

from target_service.assembly import ray_runtime
from target_service.assembly.ray_services import service_bundle
from target_service.serving.api import create_app, holder_named
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

logger = logging.getLogger(__name__)

APP_NAME = "dflash"
DEPLOYMENT_NAME = "DFlashReplica"
DRAIN_TIMEOUT_S = 60.0

HOLDER = holder_named("dflash")
APP = create_app(HOLDER)


@APP.middleware("http")
async def node_header(request, call_next):
    """Every response names the Ray node whose replica served it: placement made visible (and
    testable). Here, not in api.py: the routes know nothing of Ray."""
    response = await call_next(request)
    response.headers["X-Dflash-Node"] = _node_id()
    return response


@functools.cache
def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


@serve.ingress(APP)
class DFlashReplica:
    """The Ray Serve replica: builds one `Replica` and delegates; nothing else lives here."""

    def __init__(self, args: ServeArgs):
        context = serve.get_replica_context()
        rank = _rank(context)
        # the admin port counts replicas on this node (local rank): a pod's probes and the admin
        # Service expect admin_port + 0..n-1 on every node, whatever the global ranks there are
        self.replica = Replica(args, rank, admin_offset=_rank(context, "local_rank"))
        HOLDER.rank = rank
        HOLDER.install(self.replica.server)
        logger.info("replica %d ready on node %s", rank, _node_id())

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> int:
        """Refuse new requests (503) and wait for the running and waiting ones to finish; returns how
        many were still in flight at the start. Called on every replica before the app is deleted."""
        server = self.replica.server
        server.draining = True
        engine = server.engine
        in_flight = engine.num_running + engine.num_waiting
        deadline = time.monotonic() + timeout_s
        while engine.num_running + engine.num_waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        return in_flight

    async def check_health(self) -> None:
        """Ray Serve's probe: a replica whose engine thread died is restarted."""
        if not self.replica.server.engine.is_healthy:
            raise RuntimeError("the engine thread stopped")

    def __del__(self):  # graceful shutdown: Ray Serve has drained the requests it routed here
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.close(DRAIN_TIMEOUT_S)
            HOLDER.clear()


def _rank(context, which: str = "rank") -> int:
    """The replica's global rank, or with which="local_rank" its rank among the replicas of its node
    (Ray Serve 2.60's ReplicaRank; older versions give a plain global int)."""
    rank = getattr(context, "rank", 0)
    if isinstance(rank, int) or rank is None:
        return int(rank or 0)
    return int(getattr(rank, which, getattr(rank, "rank", 0)) or 0)


def replica_bundle(args: ServeArgs) -> dict[str, float]:
    """The replica actor's own placement-group bundle: all it needs, on one node (with services="ray"
    its GPUs go to the three service bundles instead, `replica_bundles`)."""
    bundle = {"CPU": args.num_cpus_per_replica, **args.replica_resources}
    if args.num_gpus_per_replica and args.services == "inprocess":
        bundle["GPU"] = args.num_gpus_per_replica
    return bundle


def replica_bundles(args: ServeArgs) -> list[dict[str, float]]:
    """Every bundle of one replica's placement group: its own, then (services="ray") the pool's, the
    drafter's and the target's, which `Replica` starts in bundles 1-3."""
    bundles = [replica_bundle(args)]
    if args.services == "ray":
        bundles += [service_bundle("cuda" if args.num_gpus_per_replica else "cpu")] * 3
    return bundles


def replica_deployment(args: ServeArgs) -> serve.Deployment:
    """`args.replicas` copies, each in its own STRICT_PACK placement group of `replica_bundle(args)`;
    the replica actor takes the whole bundle. No `max_replicas_per_node`: a node with eight GPUs
    holds eight replicas, one per GPU, and the resources alone say so."""
    return serve.deployment(
        DFlashReplica, name=DEPLOYMENT_NAME, num_replicas=args.replicas,
        ray_actor_options={"num_cpus": args.num_cpus_per_replica,
                           "num_gpus": replica_bundle(args).get("GPU", 0),
                           "resources": dict(args.replica_resources)},
        placement_group_bundles=replica_bundles(args), placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=max(1, args.max_num_seqs + args.max_waiting),
        graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=5.0)


def build_application(args: ServeArgs):
    """The Ray Serve application of `args`."""
    return replica_deployment(args).bind(args)


def app_builder(config: dict):
    """The application for a Ray Serve config file (KubeRay's serveConfigV2): `import_path:
    target_service.serving.deploy:app_builder`, with `args` holding `dflash serve`'s settings by their field
    names (validated like the command's flags)."""
    return build_application(ServeArgs(**config))


@contextlib.contextmanager
def serving(args: ServeArgs) -> Iterator[str]:
    """Serve `args` until the `with` block ends; yields the base URL once every replica is ready.

    On the way out: every replica drains, the application is deleted, then what this process
    started stops: a local Ray with its Serve; on a joined cluster nothing (the driver disconnects).
    """
    started_ray = start_ray(args)
    try:
        url = start_serve(args)  # refuses a taken application name before deploying anything
        try:
            serve.run(build_application(args), name=APP_NAME, route_prefix="/", blocking=False)
            yield url
        finally:
            delete_application()
    finally:
        stop_ray(started_ray)


def start_ray(args: ServeArgs) -> bool:
    """Join the cluster at `--address` (or RAY_ADDRESS); else start a local Ray on loopback. Returns
    whether this process started Ray (and so must stop it)."""
    return ray_runtime.start_ray(args.address)


def start_serve(args: ServeArgs) -> str:
    """Start Serve with one HTTP proxy, on the head node (several Ray nodes on one host share its
    address, and every node's proxy would want the port), or join the Serve already running on a
    joined cluster, whose proxy settings stay. Returns the proxy's base URL."""
    serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
    if APP_NAME in serve.status().applications:
        raise ValueError(f"Ray Serve on this cluster already runs an application named {APP_NAME!r} "
                         "(another dflash serve?); stop it first")
    from ray.serve.context import _get_global_client  # Serve's HTTP settings have no public getter

    http = _get_global_client().http_config
    if (http.host, http.port) != (args.host, args.port):
        logger.warning("Serve already runs on this cluster with its proxy on %s:%d; --host/--port are "
                       "ignored", http.host, http.port)
    return f"http://{http.host}:{http.port}"


def delete_application() -> None:
    """Drain every replica (new requests get 503, running ones finish and their responses go out),
    then delete this application, and only it."""
    try:
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, APP_NAME)
        in_flight = handle.broadcast("drain").results()
        logger.info("drained %d in-flight requests", sum(in_flight))
        time.sleep(0.5)  # the last responses leave the proxy
    except Exception as error:  # an app that never came up: nothing to drain
        logger.warning("could not drain the replicas: %s", error)
    serve.delete(APP_NAME)


def stop_ray(started_ray: bool) -> None:
    """Stop Serve and Ray if this process started them; on a joined cluster only disconnect: Serve
    keeps running there for the other applications (`serve.shutdown` would delete them all)."""
    try:
        if started_ray:
            serve.shutdown()
    finally:
        ray.shutdown()

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

Stopping (`stop_serving`, paced by this process, not by Ray Serve): every replica refuses new
requests (503) and the ones in flight run on for up to `drain_timeout_s` (or until `hurry` is set:
a second signal); then the rest are stopped with an answer (503, or an error event and `[DONE]`)
and the replicas release their engines, answering 503 from then on. A local Ray is then stopped
whole, so its proxy never answers the gap between an application's deletion and its own end with
404 (which clients do not retry): it answers 503 until its port closes. On a joined cluster the
application is deleted. When Ray Serve itself stops a replica (a redeploy, a scale-down, KubeRay),
it waits `drain_timeout_s` for the replica's requests, and the replica stops what is left.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator

import ray
from ray import serve

from target_service.assembly import ray_runtime
from target_service.assembly.ray_services import service_bundle
from target_service.serving.api import create_app, holder_named
from target_service.serving.openai_server import STOP_GRACE_S, drain_expired
from target_service.serving.replica import Replica
from target_service.serving.replica_set_metrics import ReplicaSetMetrics
from target_service.serving.replica_watch import ReplicaCounts, ReplicaWatch, watch_replicas
from target_service.serving.serve_args import ServeArgs

logger = logging.getLogger(__name__)

APP_NAME = "dflash"
DEPLOYMENT_NAME = "DFlashReplica"
DRAIN_POLL_S = 0.2
PROXY_FLUSH_S = 0.5  # the last answers leave the proxy
RAY_ANSWER_S = 15.0  # past the drain, how long stopping may wait on Ray before it gives up on it
STOPPED_AT_ONCE = ("the server was told to stop at once (a second signal) before this request finished; "
                   "retry it")

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
        self.drain_timeout_s = args.drain_timeout_s
        context = serve.get_replica_context()
        rank = _rank(context)
        # the admin port counts replicas on this node (local rank): a pod's probes and the admin
        # Service expect admin_port + 0..n-1 on every node, whatever the global ranks there are
        self.replica = Replica(args, rank, admin_offset=_rank(context, "local_rank"))
        HOLDER.rank = rank
        HOLDER.install(self.replica.server, ReplicaSetMetrics(self.replica.metrics, _replica_handle))
        logger.info("replica %d ready on node %s", rank, _node_id())

    # the steps of `stop_serving`, called on every replica (Serve handle broadcasts)

    def begin_drain(self) -> int:
        """Refuse new requests (503) from now on; returns how many are in flight."""
        return self.replica.server.begin_drain()

    def in_flight(self) -> int:
        return self.replica.server.num_in_flight

    def stop_in_flight(self, reason: str) -> int:
        """End what still runs with `reason` (503, or an error event and [DONE])."""
        return self.replica.server.stop_in_flight(reason)

    def close(self) -> None:
        """Release the engine; the routes answer 503 from now on."""
        HOLDER.clear()
        self.replica.close(0.0)

    async def metrics_families(self) -> list:
        """This replica's series, for the replica answering a scrape of /metrics (`ReplicaSetMetrics`)."""
        return await self.replica.metrics.families_within()

    async def check_health(self) -> None:
        """Ray Serve's probe: a replica whose engine thread died is restarted."""
        if not self.replica.server.engine.is_healthy:
            raise RuntimeError("the engine thread stopped")

    def __del__(self):
        """Ray Serve's graceful stop (a redeploy, a scale-down): it waited drain_timeout_s for the
        requests it routed here; what still runs is stopped with an answer, then the engine goes."""
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.server.stop_in_flight(drain_expired(self.drain_timeout_s))
            HOLDER.clear()
            replica.close(0.0)


def _replica_handle():
    """A Serve handle on this application's replicas, from inside one of them."""
    return serve.get_deployment_handle(DEPLOYMENT_NAME, APP_NAME)


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
    options = {"num_cpus": args.num_cpus_per_replica, "num_gpus": replica_bundle(args).get("GPU", 0),
               "resources": dict(args.replica_resources)}
    if args.compile_cache_dir is not None:  # the services a replica starts inherit its runtime env
        options["runtime_env"] = {"env_vars": {"TRITON_CACHE_DIR": args.compile_cache_dir}}
    return serve.deployment(
        DFlashReplica, name=DEPLOYMENT_NAME, num_replicas=args.replicas, ray_actor_options=options,
        placement_group_bundles=replica_bundles(args), placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=max(1, args.max_num_seqs + args.max_waiting),
        graceful_shutdown_timeout_s=args.drain_timeout_s + STOP_GRACE_S, graceful_shutdown_wait_loop_s=0.5,
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
def serving(args: ServeArgs, hurry: threading.Event | None = None,
            say: Callable[[str], None] | None = None) -> Iterator[str]:
    """Serve `args` until the `with` block ends; yields the base URL once every replica is ready.
    With `say`, a replica that stops (and the set whole again) is said through it while serving.

    On the way out (`stop_serving`): the replicas drain for up to `args.drain_timeout_s`, or until
    `hurry` is set, then what this process started stops.
    """
    started_ray = start_ray(args)
    deployed, watching = False, threading.Event()
    try:
        url = start_serve(args)  # refuses a taken application name before deploying anything
        deployed = True
        try:
            serve.run(build_application(args), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as error:  # Serve says only that the deployment failed; the replica said why
            raise ReplicaStartFailed(replica_failure(error)) from error
        if say is not None:
            watch_replicas(functools.partial(replica_counts, args.replicas),
                           ReplicaWatch(args.replicas, replica_log_hint(started_ray)), watching, say)
        yield url
    finally:
        watching.set()  # replicas stopping on the way out are no fault
        hurry = hurry or threading.Event()
        # Ray calls wait for its GCS, a minute each when it is going away too (one SIGTERM to every
        # process: a process group, systemd's whole cgroup): each step gets a bounded time
        handle = _bounded(replicas, RAY_ANSWER_S, "reach the replicas") if deployed else None
        if handle is not None:
            stop = functools.partial(stop_serving, handle, args.drain_timeout_s, hurry,
                                     delete=not started_ray)
            _bounded(stop, args.drain_timeout_s + STOP_GRACE_S + RAY_ANSWER_S, "drain the replicas")
        _bounded(functools.partial(stop_ray, started_ray), RAY_ANSWER_S, "stop Ray")


class ReplicaStartFailed(RuntimeError):
    """No replica came up: the error a replica's constructor raised (a setting the checkpoints refuse,
    memory the device lacks), in one line."""


def replica_failure(error: RuntimeError) -> str:
    """The last line of the replicas' own error (Serve's status keeps each deployment's message, the
    replica's traceback included), else Serve's error."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # Ray went away too: Serve's own words are all there is
        app = None
    messages = [d.message for d in app.deployments.values()] if app is not None else []
    lines = [line.strip() for message in messages for line in message.splitlines() if line.strip()]
    return f"a replica failed to start: {lines[-1] if lines else error}"


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


def replica_counts(wanted: int) -> ReplicaCounts | None:
    """The replicas of this application running now, per Ray Serve (None: not deployed)."""
    app = serve.status().applications.get(APP_NAME)
    deployment = None if app is None else app.deployments.get(DEPLOYMENT_NAME)
    if deployment is None:
        return None
    return ReplicaCounts(deployment.replica_states.get("RUNNING", 0), wanted, deployment.message)


def replica_log_hint(started_ray: bool) -> str:
    """Where a replica's own log lines are: the local Ray's session folder, or the replica's node's."""
    if started_ray:
        node = getattr(ray._private.worker, "_global_node", None)  # no public getter of the session dir
        if node is not None:
            return f"{node.get_session_dir_path()}/logs/serve/"
    return "logs/serve/ in the Ray session folder of the replica's node"


def replicas():
    """A handle on this application's replicas, once they have answered (None: Ray is gone)."""
    if not ray_runtime.local_ray_alive():
        logger.warning("Ray stopped under this command (was it sent the signal too?): no drain")
        return None
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, APP_NAME)
    handle.broadcast("in_flight").results()
    return handle


def stop_serving(handle, timeout_s: float, hurry: threading.Event, *, delete: bool) -> bool:
    """Drain every replica, stop what is left, release the engines; with `delete`, then delete this
    application, and only it (on a joined cluster; a local Ray is stopped whole instead)."""
    stopped = drain(handle, timeout_s, hurry)
    if stopped:
        logger.warning("stopped %d requests still running when the drain ended", stopped)
    handle.broadcast("close").results()
    if delete:
        serve.delete(APP_NAME)
    return True


def _bounded(step, timeout_s: float, what: str):
    """`step()` on a daemon thread for up to `timeout_s`: its result, or None when it failed or is
    still running (said in one line; stopping goes on without it)."""
    failures, results = [], []

    def run():
        try:
            results.append(step())
        except Exception as error:
            failures.append(error)

    thread = threading.Thread(target=run, name=f"dflash-stop: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("could not %s within %g s: Ray does not answer (was it sent the signal too?); "
                       "going on without it", what, timeout_s)
    elif failures:
        logger.warning("could not %s: %s", what, (str(failures[0]) or repr(failures[0])).splitlines()[0])
    return results[0] if results else None


def drain(handle, timeout_s: float, hurry: threading.Event) -> int:
    """New requests get 503 from now on; those in flight run for up to `timeout_s` (until `hurry`),
    then the rest are stopped with an answer. Returns how many were stopped."""
    in_flight = sum(handle.broadcast("begin_drain").results())
    if in_flight:
        logger.warning("draining %d in-flight requests (up to %g s; a second signal stops at once)",
                       in_flight, timeout_s)
    deadline = time.monotonic() + timeout_s
    while in_flight and not hurry.is_set() and time.monotonic() < deadline:
        hurry.wait(DRAIN_POLL_S)
        in_flight = sum(handle.broadcast("in_flight").results())
    stopped = 0
    if in_flight:
        reason = STOPPED_AT_ONCE if hurry.is_set() else drain_expired(timeout_s)
        stopped = sum(handle.broadcast("stop_in_flight", reason).results())
        deadline = time.monotonic() + STOP_GRACE_S
        while sum(handle.broadcast("in_flight").results()) and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
    time.sleep(PROXY_FLUSH_S)
    return stopped


def stop_ray(started_ray: bool) -> None:
    """Stop the local Ray this process started, whole, with its Serve (no `serve.shutdown` first: it
    would delete the application while the proxy still answers, 404 until it stops); on a joined
    cluster only disconnect, Serve keeps running there for the other applications."""
    ray.shutdown()

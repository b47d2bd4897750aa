"""`dflash serve` as a Ray Serve application: Ray Serve routes HTTP to replicas, checks their health
and drains them on shutdown; each replica is one `Replica` (the model, its engine, the OpenAI server,
the admin port).

The routes are this module's `APP`, built over the named slot `SLOT`; a replica's constructor
installs its server there. Ray Serve ships each replica a pickled copy of the app, closures included;
a named slot unpickles to that process's own slot of the same name (`api.slot_named`), so the copied
routes and the constructor meet.

Ray on one machine binds loopback only (docs/architecture.md section 8): with no `--address` (and
no RAY_ADDRESS) a local Ray is started for this command alone and stopped with it.
"""

from __future__ import annotations

import logging
import os
import time

from ray import serve

from target_service.api import create_app, slot_named
from target_service.replica import Replica
from target_service.serve_args import ServeArgs

logger = logging.getLogger(__name__)

NAMESPACE = "dflash"
APP_NAME = "dflash"
DRAIN_TIMEOUT_S = 60.0
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_AUTH_MODE": "disabled"}

SLOT = slot_named("dflash")
APP = create_app(SLOT)


@serve.ingress(APP)
class DFlashReplica:
    """The Ray Serve replica: builds one `Replica` and delegates; nothing else lives here."""

    def __init__(self, args: ServeArgs):
        rank = _rank(serve.get_replica_context())
        self.replica = Replica(args, rank)
        SLOT.rank = rank
        SLOT.install(self.replica.server)

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


def _rank(context) -> int:
    rank = getattr(context, "rank", 0)
    return int(getattr(rank, "rank", rank) or 0)


def build_application(args: ServeArgs):
    """The Ray Serve application of `args`: `args.replicas` copies, each with its own resources."""
    deployment = serve.deployment(
        DFlashReplica, name="DFlashReplica", num_replicas=args.replicas,
        ray_actor_options={"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica},
        max_ongoing_requests=max(1, args.max_num_seqs + args.max_waiting),
        graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=5.0)
    return deployment.bind(args)


def app_builder(config: dict):
    """The application for a Ray Serve config file (KubeRay's serveConfigV2): `import_path:
    target_service.deploy:app_builder`, with `args` holding `dflash serve`'s settings by their field
    names (validated like the command's flags)."""
    return build_application(ServeArgs(**config))


def start_ray(args: ServeArgs) -> bool:
    """Join the cluster at `--address` (or RAY_ADDRESS); else start a local Ray on loopback.
    Returns whether this process started Ray (and so must stop it)."""
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return False
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    return True


def serve_application(args: ServeArgs) -> str:
    """Deploy (or update) the application; returns its base URL once every replica is ready."""
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{args.host}:{args.port}"


def stop(started_ray: bool) -> None:
    """Drain every replica (new requests get 503, running ones finish and their responses go out),
    remove the application, then stop Ray if this process started it (never another's)."""
    import ray

    try:
        try:
            handle = serve.get_deployment_handle("DFlashReplica", APP_NAME)
            in_flight = handle.broadcast("drain").results()
            logger.info("drained %d in-flight requests", sum(in_flight))
            time.sleep(0.5)  # the last responses leave the proxy
        except Exception as error:  # an app that never came up: nothing to drain
            logger.warning("could not drain the replicas: %s", error)
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()

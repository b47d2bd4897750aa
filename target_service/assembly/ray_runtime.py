"""Joining or starting Ray, the one way every dflash entry point does it, with Ray's token
authentication on either way (docs/architecture.md section 8, "What listens where").

- No address: a local Ray for this process alone. Its node IP is 127.0.0.1, so its GCS, raylet,
  workers and agents bind loopback (all but Ray Serve's replicas, whose inter-deployment gRPC server
  Ray 2.60 binds to [::]: the token closes it); the dashboard is off, usage stats too, and it has a
  token of its own: 256 random bits in a 0600 file in a 0700 temporary directory, which
  RAY_AUTH_TOKEN_PATH names to every process Ray starts, removed when this process exits.
- With an address (`--address`, or RAY_ADDRESS: `host:port` of a cluster's GCS, or `ray://host:10001`):
  join that cluster with its token, from RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or
  ~/.ray/auth_token (Ray's order); without one, a one-line error says where to put it.

RAY_AUTH_MODE is `token` in both cases: any other value in the environment is overridden, with a
warning. The caller stops Ray only if it started it, and never with `ray stop`, which would kill every
Ray process on the machine.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

NAMESPACE = "dflash"
CLIENT_CONNECT_ATTEMPTS = 3  # Ray Client's server sometimes fails to start the session's own server
CLIENT_RETRY_S = 2.0
AUTH_MODE = "token"
DEFAULT_TOKEN_FILE = Path(".ray") / "auth_token"  # under the home directory: where `ray get-auth-token` looks


def start_ray(address: str | None, **init_kwargs) -> bool:
    """Connect this process to Ray (unless it already is); returns whether it started a local Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        check_cluster_token(address)
        _turn_on_token_auth()
        _join(ray, address, init_kwargs)
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _loopback_node()
    write_local_token()
    _turn_on_token_auth()
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, **init_kwargs)
    return True


def local_ray_alive() -> bool:
    """False when this process started a local Ray whose GCS or raylet has died since (a signal sent
    to the whole process group reaches them too): every Ray call would then wait a minute for the GCS
    before failing. True otherwise (no local Ray, or a joined cluster: nothing here to look at)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # no public view of the local processes
    if node is None or not getattr(node, "head", False):
        return True
    dead = {kind for kind, _ in node.dead_processes()}
    return not dead & {"gcs_server", "raylet"}


def check_cluster_token(address: str) -> None:
    """Refuse, in one sentence, to join `address` without its token (Ray would start, then fail)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if named:
        if not _holds_token(Path(named)):
            raise ValueError(f"RAY_AUTH_TOKEN_PATH names {named}, which is missing, unreadable or empty; "
                             f"it must hold the token of the Ray cluster at {address}")
        return
    if not _holds_token(Path.home() / DEFAULT_TOKEN_FILE):
        raise ValueError(f"the Ray cluster at {address} needs its authentication token: set "
                         "RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to a file holding it, or write it to "
                         f"~/{DEFAULT_TOKEN_FILE} (`ray get-auth-token` on the head prints it)")


def write_local_token() -> Path:
    """A fresh token for the local Ray about to start, in a file only this user can read; Ray's
    processes inherit RAY_AUTH_TOKEN_PATH (RAY_AUTH_TOKEN is dropped: it would win over the file).
    The directory goes when this process exits, after Ray's own exit hook has stopped Ray (atexit
    runs hooks last-registered first, and ray.init registers its hook after this one)."""
    directory = Path(tempfile.mkdtemp(prefix="dflash-ray-auth-"))  # mode 0700
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = directory / "auth_token"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    return path


def _holds_token(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


def _turn_on_token_auth() -> None:
    """RAY_AUTH_MODE=token for this process and every process Ray starts from it."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode not in (None, AUTH_MODE):
        logger.warning("RAY_AUTH_MODE=%s is ignored: dflash runs Ray with token authentication", mode)
    os.environ["RAY_AUTH_MODE"] = AUTH_MODE
    _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Ray reads RAY_AUTH_MODE once, when `ray` is imported, and keeps the first token it loads: read
    both again, as ray.init does itself when it turns authentication on for a new local cluster (Ray
    2.60 has no public call for either). The mode before the token, as Ray's own reset does."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _loopback_node() -> None:
    """Node IP 127.0.0.1: Ray's GCS, raylet and workers then listen on loopback only (with any other
    node IP they listen on every interface, and the agents on the host's address). Ray picks the
    loopback IP when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is 0, which it reads once, when `ray` is first
    imported, usually before this runs (serving/deploy.py imports ray first): the variable is for the
    processes Ray starts, the constant for this one."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _join(ray, address: str, init_kwargs: dict) -> None:
    """ray.init on a running cluster. Through Ray Client (ray://) the cluster's client server starts a
    server process per session, and that start sometimes fails at once ("Initialization failure from
    server"); a fresh session is then asked for, a few times, before the error stands."""
    attempts = CLIENT_CONNECT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, **init_kwargs)
            return
        except ConnectionError as error:
            if attempt == attempts:
                raise
            logger.warning("Ray Client at %s: %s; connecting again (%d of %d)", address,
                           str(error).splitlines()[0], attempt + 1, attempts)
            ray.shutdown()
            time.sleep(CLIENT_RETRY_S)

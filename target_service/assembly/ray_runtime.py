"""Joining or starting Ray, the one way every dflash entry point does it.

With an address (`--address`, or RAY_ADDRESS: `host:port` of a cluster's GCS, or `ray://host:10001`)
join that cluster; else start a local Ray bound to loopback with no telemetry and no auth prompt
(docs/architecture.md section 8). The caller stops Ray only if it started it, and never with
`ray stop`, which would kill every Ray process on the machine.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

NAMESPACE = "dflash"
CLIENT_CONNECT_ATTEMPTS = 3  # Ray Client's server sometimes fails to start the session's own server
CLIENT_RETRY_S = 2.0
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_AUTH_MODE": "disabled"}


def start_ray(address: str | None, **init_kwargs) -> bool:
    """Connect this process to Ray (unless it already is); returns whether it started a local Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _join(ray, address, init_kwargs)
        return False
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, **init_kwargs)
    return True


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

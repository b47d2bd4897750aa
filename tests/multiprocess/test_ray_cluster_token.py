"""Joining a Ray that runs with token authentication, as `dflash serve --address` does (start_ray with
an address, in a fresh process): with the cluster's token it joins; without one it is refused in one
line before Ray starts; with a wrong one Ray's GCS refuses it. The cluster is a local Ray this test
process starts the way the server does (start_ray without an address)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tiers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_machine")]
JOIN = ("import ray; from target_service.assembly.ray_runtime import start_ray; "
        "start_ray({address!r}); print('nodes', len(ray.nodes()))")


@pytest.fixture(scope="module")
def cluster(ray_machine):
    """The GCS address of a local Ray and the path of its token file."""
    import ray

    from target_service.assembly.ray_runtime import start_ray

    started = start_ray(None, num_cpus=1)
    try:
        yield ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN_PATH"]
    finally:
        if started:
            ray.shutdown()


def join(address: str, **auth: str) -> subprocess.CompletedProcess:
    """`start_ray(address)` in a fresh process whose Ray settings are `auth` alone."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("RAY_AUTH", "RAY_ADDR"))}
    env.update(HOME=os.environ.get("HOME", "/"), PYTHONPATH=str(ROOT))
    env.update(auth)
    return subprocess.run([sys.executable, "-c", JOIN.format(address=address)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_driver_with_the_clusters_token_joins(cluster):
    address, token_file = cluster
    joined = join(address, RAY_AUTH_TOKEN_PATH=token_file)
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert "nodes 1" in joined.stdout


def test_a_driver_without_a_token_is_told_in_one_line_where_to_put_it(cluster, tmp_path):
    address, _ = cluster
    refused = join(address, HOME=str(tmp_path))  # no ~/.ray/auth_token either
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: the Ray cluster at {address} needs its authentication token")


def test_a_driver_with_a_wrong_token_is_refused_by_the_gcs(cluster):
    address, _ = cluster
    # Ray retries the GCS about once a second, 20 times by default, before it gives up on a refusal;
    # two tries hear the same refusal in 2.5 s instead of 20.
    refused = join(address, RAY_AUTH_TOKEN="0" * 64, RAY_NUM_REDIS_GET_RETRIES="2")
    assert refused.returncode != 0
    assert "InvalidAuthToken" in refused.stderr and "nodes" not in refused.stdout

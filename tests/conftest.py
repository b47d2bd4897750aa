"""Test-wide setup: the Triton interpreter on machines without a GPU, the `gpu` marker, and each
test's tier as a marker named after its folder (`-m unit`, `-m "not cluster"`; docs/architecture.md
section 10).

TRITON_INTERPRET must be set before triton is first imported, so this runs at the very top.
"""

import os
import secrets

import torch

HAS_CUDA = torch.cuda.is_available()
# Test tensors are tiny: one intra-op thread per worker is far faster than threads spinning against
# each other (and against the other xdist worker) on a 2-core machine.
torch.set_num_threads(1)
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Ray on one machine: loopback only, no telemetry, token authentication on (docs/architecture.md
# section 8). A Ray the tests start themselves (ray.cluster_utils.Cluster) runs with this process's
# token, and so does a `dflash serve --address` joining it; start_ray gives a local Ray its own.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from tiers import tier_of  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        tier = tier_of(Path(item.fspath))
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        if not HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def ray_machine():
    """Holds this machine's Ray tests one module at a time, across xdist workers too: two local Ray
    clusters and their model replicas at once overload two cores past the tests' startup timeouts.
    `--dist loadgroup` keeps the "ray" group on one worker (with pytest below 9.2, which pyproject
    pins: 9.2 stores node ids where xdist 3.8 cannot tag them, and the group's modules were then split
    across the workers, each setting up its module's server once more); this lock still holds if
    the group is ever split again."""
    import fcntl
    import tempfile
    from pathlib import Path

    with open(Path(tempfile.gettempdir()) / "dflash-ray-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

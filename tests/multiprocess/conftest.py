"""The `served` fixture (a CPU step channel with one server process attached, step_channel_servers), and
for the Ray tests a local Ray (loopback, token auth) and a tiny pair, one per module."""

import pytest
from engine_helpers import make_pair
from step_channel_servers import Served


@pytest.fixture
def served():
    served = Served()
    served.start_server()
    yield served
    served.close()


@pytest.fixture(scope="module")
def ray_local(ray_machine):
    import ray

    from target_service.assembly.ray_runtime import start_ray

    started = start_ray(None, num_cpus=4)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))

"""The `served` fixture: a CPU step channel with one server process attached (step_channel_servers)."""

import pytest
from step_channel_servers import Served


@pytest.fixture
def served():
    served = Served()
    served.start_server()
    yield served
    served.close()

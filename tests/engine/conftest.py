"""`pool_transport`: run an engine test against the in-process pool and against a remote one.

"remote" puts the engine's BlockManager behind a real gRPC server on loopback and hands the
scheduler a KVPoolClient, so every open / reserve / commit / close of the test crosses the wire.
"""

import pytest


@pytest.fixture(params=["local", "remote"])
def pool_transport(request, monkeypatch):
    if request.param == "local":
        yield "local"
        return
    import target_service.llm as llm_module  # imported here: GPU machines may lack the gRPC extras
    from kvpool_service.client import KVPoolClient
    from kvpool_service.server import BackgroundServer

    servers = []
    build = llm_module.build_engine

    def remote_control(pool):
        server = BackgroundServer(pool.blocks, pool.layout).start()
        servers.append(server)
        client = KVPoolClient(server.address)
        client.connect()
        return client

    def build_with_remote_pool(args):
        return build(args, control=remote_control)

    monkeypatch.setattr(llm_module, "build_engine", build_with_remote_pool)
    yield "remote"
    for server in servers:
        server.stop()

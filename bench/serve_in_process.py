"""`dflash serve`'s HTTP app over one `Replica`, in this process, without Ray Serve: for benchmarks on
machines that cannot carry Ray Serve (the H200's carry limit). The replica is built as each Ray Serve
replica builds it, its server installed in a `ServerHolder`, and `create_app(holder)` served by uvicorn
on 127.0.0.1 in a thread; on the way out the replica closes, the holder lets go of it, and the device
memory it held can be released.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

TRANSPORT = "h11 over asyncio"  # uvicorn's pure-Python protocol and loop: the carried wheels hold no more
STARTUP_TIMEOUT_S = 60.0


@contextlib.contextmanager
def http_server(app) -> Iterator[str]:
    """`app` under uvicorn on a free port of 127.0.0.1, in a background thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(STARTUP_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def replica_server(serve_args) -> Iterator[tuple[str, object]]:
    """A `Replica` of `serve_args` installed in a holder (as `deploy.DFlashReplica` does) behind
    `create_app(holder)`; yields (URL, replica); closes the replica on the way out."""
    from target_service.serving.api import ServerHolder, create_app
    from target_service.serving.replica import Replica

    replica = Replica(serve_args)
    holder = ServerHolder()
    try:
        holder.rank = 0
        holder.install(replica.server, replica.metrics)
        with http_server(create_app(holder)) as url:
            yield url, replica
    finally:
        replica.close()
        holder.clear()  # else the routes, cached by FastAPI for the process's life, keep the engine


def release_device() -> None:
    """Free what the last engine left: garbage, then the CUDA caching allocator's blocks."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_allocated() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0

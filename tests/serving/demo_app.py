"""The demo pair served in process for the HTTP tests: a Replica over ServeArgs and its app (no
socket), and one POST through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import httpx

from target_service.serving.api import ServerHolder, create_app
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

DEMO_ARGS = dict(admin_port=None, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory="16MiB",
                 max_num_seqs=8)


@contextmanager
def demo_app(**args):
    """(replica, app) over DEMO_ARGS with `args` over them; the replica is closed after."""
    replica = Replica(ServeArgs(**{**DEMO_ARGS, **args}))
    try:
        holder = ServerHolder()
        holder.install(replica.server)
        yield replica, create_app(holder)
    finally:
        replica.close(0.0)


def post(app, path: str, body: dict) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as http:
            return await http.post(path, json=body)
    return asyncio.run(main())

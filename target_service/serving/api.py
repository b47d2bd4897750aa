"""The HTTP routes of the OpenAI-compatible API: parse, authenticate, call `OpenAIServer`, send.

`create_app(holder)` builds the FastAPI app; the `ServerHolder` holds the process's `OpenAIServer` once
it is built (a Ray Serve replica installs it in its constructor; tests install their own). Every
error is OpenAI-shaped (`{"error": {...}}`) with its status and, for 429/503, Retry-After.
`/health` and `/metrics` need no API key (probes and scrapers carry none).
"""

from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from target_service.serving.api_errors import ApiError
from target_service.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from target_service.serving.openai_server import OpenAIServer

DISCONNECT_POLL_S = 0.1


class ServerHolder:
    """Where the routes find this process's server; empty until it is installed.

    A named holder is process-wide: pickling one (Ray Serve ships a copy of the app, closures and all,
    to every replica process) and unpickling it gives that process's holder of the same name, so the
    replica's constructor and the copied routes meet. An unnamed holder stays in its process.
    """

    def __init__(self, name: str | None = None):
        self.name = name
        self._server: OpenAIServer | None = None
        self._closed = False
        self.rank: int | None = None  # the Ray Serve replica's rank, named in X-Dflash-Replica

    def __reduce__(self):
        if self.name is None:
            raise TypeError("an unnamed ServerHolder cannot leave its process; use holder_named()")
        return (holder_named, (self.name,))

    def install(self, server: OpenAIServer) -> None:
        self._server = server
        self._closed = False

    def clear(self) -> None:
        """Let go of the server once its replica closed. The routes keep this holder for as long as
        FastAPI's module-level caches hold the routes (the whole process), so a holder that kept its
        server would keep the engine, its weights and its pool in memory after close."""
        self._server, self._closed = None, True

    @property
    def is_installed(self) -> bool:
        return self._server is not None

    @property
    def server(self) -> OpenAIServer:
        if self._server is None:
            raise ApiError.unavailable(1, "this replica has shut down" if self._closed
                                       else "the model is still loading")
        return self._server


_NAMED_HOLDERS: dict[str, ServerHolder] = {}


def holder_named(name: str) -> ServerHolder:
    """This process's holder called `name` (made on first use)."""
    if name not in _NAMED_HOLDERS:
        _NAMED_HOLDERS[name] = ServerHolder(name)
    return _NAMED_HOLDERS[name]


def create_app(holder: ServerHolder) -> FastAPI:
    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def replica_header(request: Request, call_next):
        """Every response names the replica that served it: routing made visible (and testable)."""
        response = await call_next(request)
        if holder.rank is not None:
            response.headers["X-Dflash-Replica"] = str(holder.rank)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=error.headers)

    @app.get("/health")
    async def health() -> Response:
        healthy = holder.is_installed and holder.server.is_healthy
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "unavailable"}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        server = holder.server
        body = server.metrics.render() if server.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server = _authorized(holder, request)
        return JSONResponse(server.models().model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server = _authorized(holder, request)
        body = CompletionRequest.from_body(await _json(request))
        return await _answer(request, body, server.completion, server.completion_stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server = _authorized(holder, request)
        body = ChatCompletionRequest.from_body(await _json(request))
        return await _answer(request, body, server.chat, server.chat_stream)

    return app


def _authorized(holder: ServerHolder, request: Request) -> OpenAIServer:
    server = holder.server
    if server.api_key is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
            raise ApiError.unauthorized()
    return server


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except ValueError:
        raise ApiError.bad_request("the request body is not valid JSON") from None


async def _answer(request: Request, body, whole, stream) -> Response:
    """An SSE stream when the body asks for one, else the whole response as JSON."""
    if body.stream:
        return _sse(stream(body))
    return JSONResponse((await _until_disconnected(request, whole(body))).model_dump())


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _until_disconnected(request: Request, work):
    """Run `work`; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "the client closed the request", "client_closed_request")
        return task.result()
    finally:
        if not task.done():
            task.cancel()

"""The HTTP routes of the OpenAI-compatible API: parse, authenticate, call `OpenAIServer`, send.

`create_app(holder)` builds the FastAPI app; the `ServerHolder` holds the process's `OpenAIServer` once
it is built (a Ray Serve replica installs it in its constructor; tests install their own).
`/health`, `/metrics`, `/openapi.json` and `/docs` need no API key (probes, scrapers and schema tools
carry none).

Every error is OpenAI-shaped (`{"error": {...}}`) with its status and, for 429/503, Retry-After:
the routes' `ApiError`s, FastAPI's own 404/405/422 (a 422 becomes OpenAI's 400), the 413 of the
body limit, and any unexpected exception, which is logged and answered 500 (or, mid-stream, an
error event and `[DONE]`).

The body is read within its limits by `request_body.read_json`, the middleware is
`middleware.py`, and the schema `/openapi.json` serves is `openapi_schema.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from target_service.serving.api_errors import ApiError, param_path
from target_service.serving.chat_request import ChatCompletionRequest
from target_service.serving.middleware import BodyLimit, Boundary, error_response
from target_service.serving.openai_protocol import CompletionRequest
from target_service.serving.openai_responses import (
    SSE_DONE,
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
    sse_event,
)
from target_service.serving.openai_server import OpenAIServer
from target_service.serving.openapi_schema import openapi_schema, request_body, responses
from target_service.serving.request_body import MAX_BODY_BYTES, read_json

logger = logging.getLogger(__name__)

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
        self._metrics = None
        self._closed = False
        self.rank: int | None = None  # the Ray Serve replica's rank, named in X-Dflash-Replica

    def __reduce__(self):
        if self.name is None:
            raise TypeError("an unnamed ServerHolder cannot leave its process; use holder_named()")
        return (holder_named, (self.name,))

    def install(self, server: OpenAIServer, metrics=None) -> None:
        """metrics: this replica's `ServerMetrics`, or in Ray Serve every replica's
        (`ReplicaSetMetrics`); None: /metrics answers an empty text."""
        self._server, self._metrics = server, metrics
        self._closed = False

    def clear(self) -> None:
        """Let go of the server once its replica closed. The routes keep this holder for as long as
        FastAPI's module-level caches hold the routes (the whole process), so a holder that kept its
        server would keep the engine, its weights and its pool in memory after close."""
        self._server, self._metrics, self._closed = None, None, True

    @property
    def is_installed(self) -> bool:
        return self._server is not None

    @property
    def server(self) -> OpenAIServer:
        if self._server is None:
            raise ApiError.unavailable(1, "this replica has shut down" if self._closed
                                       else "the model is still loading")
        return self._server

    @property
    def metrics(self):
        """What /metrics answers (anything with `async exposition() -> bytes`; None: nothing); like
        `server`, a 503 while the model loads or after shutdown."""
        return self._metrics if self.server is not None else None


_NAMED_HOLDERS: dict[str, ServerHolder] = {}


def holder_named(name: str) -> ServerHolder:
    """This process's holder called `name` (made on first use)."""
    if name not in _NAMED_HOLDERS:
        _NAMED_HOLDERS[name] = ServerHolder(name)
    return _NAMED_HOLDERS[name]


def create_app(holder: ServerHolder) -> FastAPI:
    app = FastAPI(title="dflash-serve", version="1", summary="An OpenAI-compatible API (vLLM's shape)",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(Boundary, holder=holder)  # added last: the outermost of the two

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """FastAPI's own refusals (no such route, wrong method), OpenAI-shaped."""
        method, path = request.method, request.url.path
        if error.status_code == 404:
            return error_response(ApiError.unknown_url(method, path))
        if error.status_code == 405:
            allow = (error.headers or {}).get("Allow", "")
            return error_response(ApiError.method_not_allowed(method, path, allow))
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return error_response(ApiError(error.status_code, str(error.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 is OpenAI's (and vLLM's) 400 naming the field."""
        first = error.errors()[0]
        param = param_path([part for part in first.get("loc", ()) if part != "body"])
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
        return error_response(ApiError.bad_request(message, param))

    @app.get("/health")
    async def health() -> Response:
        healthy = holder.is_installed and holder.server.is_healthy
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "unavailable"}, status_code=status)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        metrics = holder.metrics
        body = await metrics.exposition() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=responses(ModelList, stream=False))
    async def models(request: Request) -> JSONResponse:
        server = _authorized(holder, request)
        return JSONResponse(server.models().model_dump())

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses=responses(CompletionResponse))
    async def completions(request: Request) -> Response:
        server = _authorized(holder, request)
        body = CompletionRequest.from_body(await read_json(request))
        return await _answer(request, body, server.completion, server.completion_stream)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses=responses(ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        server = _authorized(holder, request)
        body = ChatCompletionRequest.from_body(await read_json(request))
        return await _answer(request, body, server.chat, server.chat_stream)

    app.openapi = lambda: openapi_schema(app, (CompletionRequest, ChatCompletionRequest),
                                         holder.server.limits if holder.is_installed else None)
    return app


# ---- requests ---------------------------------------------------------------------------------


def _authorized(holder: ServerHolder, request: Request) -> OpenAIServer:
    server = holder.server
    if server.api_key is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
            raise ApiError.unauthorized()
    return server


# ---- answers ----------------------------------------------------------------------------------


async def _answer(request: Request, body, whole, stream) -> Response:
    """An SSE stream when the body asks for one, else the whole response as JSON."""
    if body.stream:
        return _sse(await stream(body))
    return JSONResponse((await _until_disconnected(request, whole(body))).model_dump())


def _sse(events) -> StreamingResponse:
    return StreamingResponse(_guarded(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _guarded(events):
    """The events, and if one fails unexpectedly mid-stream, an OpenAI error event and [DONE] (the
    status line is long sent). Closing this closes `events`, which aborts their requests at once."""
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except Exception as error:
            logger.exception("a stream failed")
            failure = ApiError.internal(f"the server failed mid-stream ({type(error).__name__}); "
                                        "the server log has the details")
            yield sse_event(failure.to_response())
            yield SSE_DONE


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

"""The HTTP routes of the OpenAI-compatible API: parse, authenticate, call `OpenAIServer`, send.

`create_app(holder)` builds the FastAPI app; the `ServerHolder` holds the process's `OpenAIServer` once
it is built (a Ray Serve replica installs it in its constructor; tests install their own).
`/health`, `/metrics`, `/openapi.json` and `/docs` need no API key (probes, scrapers and schema tools
carry none).

Every error is OpenAI-shaped (`{"error": {...}}`) with its status and, for 429/503, Retry-After:
the routes' `ApiError`s, FastAPI's own 404/405/422 (a 422 becomes OpenAI's 400), the 413 of the
body limit, and any unexpected exception, which is logged and answered 500 (or, mid-stream, an
error event and `[DONE]`).

The body is read and parsed here, before anything else looks at it:

| limit                   | value                  | past it                                          |
| body size               | MAX_BODY_BYTES (8 MiB) | 413, from Content-Length before reading, or once |
|                         |                        | the bytes read pass it (chunked bodies)          |
| JSON nesting depth      | MAX_JSON_DEPTH (64)    | 400; the deepest real request nests 5 levels     |
| NaN, Infinity           | not JSON numbers       | 400                                              |
| a number past a double  | +-1.8e308              | 400 (RFC 8259's interoperable range)             |
| a lone surrogate        | not Unicode text       | 400 naming the field ("\\ud800" cannot be        |
|                         |                        | tokenized or echoed)                             |

8 MiB holds a 128k-token prompt several times over, as text or as token ids. The field limits (n,
the batch, the stop strings) are the request models' (`openai_protocol.py`).

The OpenAPI schema (`/openapi.json`, `/docs`) declares each body as the very model that parses it:
the routes read the JSON themselves (to apply the limits above first), so the schema is attached with
`openapi_extra`, and its components are those models' `model_json_schema()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from target_service.serving.api_errors import ApiError, ErrorResponse, param_path
from target_service.serving.openai_protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    sse_event,
)
from target_service.serving.openai_server import OpenAIServer

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
MAX_BODY_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_SCHEMA_REF = "#/components/schemas/{model}"


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
    app = FastAPI(title="dflash-serve", version="1", summary="An OpenAI-compatible API (vLLM's shape)",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(Boundary, holder=holder)  # added last: the outermost of the two

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """FastAPI's own refusals (no such route, wrong method), OpenAI-shaped."""
        method, path = request.method, request.url.path
        if error.status_code == 404:
            return _error_response(ApiError.unknown_url(method, path))
        if error.status_code == 405:
            allow = (error.headers or {}).get("Allow", "")
            return _error_response(ApiError.method_not_allowed(method, path, allow))
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return _error_response(ApiError(error.status_code, str(error.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 is OpenAI's (and vLLM's) 400 naming the field."""
        first = error.errors()[0]
        param = param_path([part for part in first.get("loc", ()) if part != "body"])
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
        return _error_response(ApiError.bad_request(message, param))

    @app.get("/health")
    async def health() -> Response:
        healthy = holder.is_installed and holder.server.is_healthy
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "unavailable"}, status_code=status)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        server = holder.server
        body = server.metrics.render() if server.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_answers(ModelList, stream=False))
    async def models(request: Request) -> JSONResponse:
        server = _authorized(holder, request)
        return JSONResponse(server.models().model_dump())

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest),
              responses=_answers(CompletionResponse))
    async def completions(request: Request) -> Response:
        server = _authorized(holder, request)
        body = CompletionRequest.from_body(await _json(request))
        return await _answer(request, body, server.completion, server.completion_stream)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest),
              responses=_answers(ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        server = _authorized(holder, request)
        body = ChatCompletionRequest.from_body(await _json(request))
        return await _answer(request, body, server.chat, server.chat_stream)

    app.openapi = lambda: _openapi(app, (CompletionRequest, ChatCompletionRequest))
    return app


# ---- the boundary: every response named, every failure OpenAI-shaped, the body capped -------------


class Boundary:
    """ASGI middleware around everything the routes do: names the replica in every response
    (X-Dflash-Replica), and turns any exception that escapes into a logged, OpenAI-shaped 500.
    (Plain ASGI, not an `@app.middleware`: those see no exception raised by a route.)"""

    def __init__(self, app, holder: ServerHolder):
        self.app, self.holder = app, holder

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def named(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.holder.rank is not None:
                    rank = str(self.holder.rank).encode()
                    message["headers"] = [*message.get("headers", ()), (b"x-dflash-replica", rank)]
            await send(message)

        try:
            await self.app(scope, receive, named)
        except Exception as error:
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:  # the response is under way: nothing left to say but to cut it
                raise
            failure = ApiError.internal(f"the server failed on this request ({type(error).__name__}); "
                                        "the server log has the details")
            await _error_response(failure)(scope, receive, named)


class BodyLimit:
    """ASGI middleware: a body past `max_bytes` is a 413 before it is parsed: at once when its
    Content-Length says so, else as soon as the bytes read pass the limit (a chunked body)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                refusal = ApiError.bad_request("the Content-Length header is not a byte count")
                return await _error_response(refusal)(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await _error_response(ApiError.too_large(self.max_bytes))(scope, receive, send)
        read = 0

        async def capped():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_bytes:
                    raise ApiError.too_large(self.max_bytes)  # in the route's read: its handler answers
            return message

        await self.app(scope, capped, send)


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=error.headers)


# ---- requests ---------------------------------------------------------------------------------


def _authorized(holder: ServerHolder, request: Request) -> OpenAIServer:
    server = holder.server
    if server.api_key is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
            raise ApiError.unauthorized()
    return server


async def _json(request: Request):
    """The body as JSON, within the limits above: 400 for anything JSON parsing refuses or lets
    through that nothing downstream can take."""
    try:
        body = json.loads(await request.body(), parse_constant=_no_constant, parse_float=_double,
                          parse_int=_integer)
    except RecursionError:  # nested past Python's own limit: far past ours
        raise _too_deep() from None
    except ValueError as error:
        raise ApiError.bad_request(f"the request body is not valid JSON: {error}") from None
    check_json(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _double(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:24]} is past the range of a double")
    return value


def _integer(text: str) -> int:
    value = int(text)  # past 4300 digits Python refuses it (ValueError) before any arithmetic
    if abs(value) > sys.float_info.max:
        raise ValueError(f"the number {text[:24]}... is past the range of a double")
    return value


def _too_deep() -> ApiError:
    return ApiError.bad_request(
        f"the request body nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects")


def check_json(body) -> None:
    """Refuse (400) a parsed body nested deeper than MAX_JSON_DEPTH, or holding a lone surrogate in
    any string or key, named by its path ("messages[0].content"). Iterative: no depth can overflow
    the stack here; a path is spelled only for the refusal."""
    if not isinstance(body, dict | list):
        return
    stack = [(body, None, 1)]  # (container, its path as (parent path, key) links, depth)
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise _surrogate(path)
            if isinstance(child, str):
                if not child.isascii() and _SURROGATE.search(child):
                    raise _surrogate((path, key))
            elif isinstance(child, dict | list):
                stack.append((child, (path, key), depth + 1))


def _surrogate(path) -> ApiError:
    parts = []
    while path is not None:
        path, key = path
        parts.append(key)
    param = param_path(parts[::-1])
    where = param or "the request body"
    return ApiError.bad_request(f"{where}: the text holds a lone surrogate (U+D800..U+DFFF), which is not "
                                "Unicode text; send valid UTF-8 (or surrogate pairs)", param)


# ---- answers ----------------------------------------------------------------------------------


async def _answer(request: Request, body, whole, stream) -> Response:
    """An SSE stream when the body asks for one, else the whole response as JSON."""
    if body.stream:
        return _sse(stream(body))
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


# ---- the OpenAPI schema -----------------------------------------------------------------------

_ERROR_STATUSES = {400: "a bad field (named by param), or a request that can never succeed",
                   401: "a missing or wrong API key", 404: "no such model", 413: "the body is too large",
                   429: "at capacity; retry after Retry-After", 500: "a server fault",
                   503: "starting or shutting down; retry after Retry-After"}


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string",
    "description": "a stream chunk as JSON (the choices' increments; the usage last, when asked), an "
                   "ErrorResponse as JSON, or [DONE] last"}}}


def _body(model: type[BaseModel]) -> dict:
    """A route's request body in the schema: `model` itself (its schema is in the components)."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _answers(model: type[BaseModel], *, stream: bool = True) -> dict:
    ok = {"model": model, "description": "the response" + (
        "; with stream true, server-sent events of its chunks, then `data: [DONE]`" if stream else "")}
    if stream:  # on OpenAPI 3.1 the schema of a text/event-stream is that of one event
        ok["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    errors = {status: {"model": ErrorResponse, "description": why} for status, why in _ERROR_STATUSES.items()}
    return {200: ok, **errors}


def _openapi(app: FastAPI, request_models) -> dict:
    """FastAPI's schema of the routes, with the request models' own schemas as components."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, part in request_schemas(request_models).items():
            if components.get(name, part) != part:
                raise RuntimeError(f"two schemas are named {name} in the OpenAPI components")
            components[name] = part
        app.openapi_schema = schema
    return app.openapi_schema


def request_schemas(models) -> dict[str, dict]:
    """Each model's `model_json_schema()` and the models it nests, by name, with references into
    the OpenAPI components (where OpenAPI looks for them) instead of a `$defs` of their own."""
    schemas = {}
    for model in models:
        schema = model.model_json_schema(ref_template=_SCHEMA_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas

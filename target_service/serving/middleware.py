"""The ASGI middleware around the routes: every response names its replica, every failure that
escapes is an OpenAI-shaped 500, and a body past its limit is a 413 before it is parsed."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from target_service.serving.api_errors import ApiError

logger = logging.getLogger(__name__)


class Boundary:
    """ASGI middleware around everything the routes do: names the replica in every response
    (X-Dflash-Replica), and turns any exception that escapes into a logged, OpenAI-shaped 500.
    (Plain ASGI, not an `@app.middleware`: those see no exception raised by a route.)"""

    def __init__(self, app, holder):  # an api.ServerHolder
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
            await error_response(failure)(scope, receive, named)


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
                return await error_response(refusal)(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await error_response(ApiError.too_large(self.max_bytes))(scope, receive, send)
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


def error_response(error: ApiError) -> JSONResponse:
    """`error` as the OpenAI error body, with its status and headers (Retry-After)."""
    return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=error.headers)

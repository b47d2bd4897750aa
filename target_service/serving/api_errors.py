"""OpenAI-shaped errors of the HTTP API: the body (`{"error": {message, type, param, code}}`), the
status, and Retry-After, built by one exception type the server raises wherever it refuses.
"""

from __future__ import annotations

import json
import math

from pydantic import BaseModel, ValidationError


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """{"error": {"message", "type", "param", "code"}}, as OpenAI shapes it."""

    error: ErrorInfo


class ApiError(Exception):
    """A refusal the client sees: HTTP status, OpenAI's error body, and Retry-After when given.

    | status | type                  | code                | when                                       |
    | 400    | invalid_request_error | None                | a bad field (`param` names it), a body     |
    |        |                       |                     | that is no JSON or nests too deep, or a    |
    |        |                       |                     | request no queue could ever take           |
    | 401    | invalid_request_error | invalid_api_key     | a missing or wrong bearer token            |
    | 404    | invalid_request_error | model_not_found     | `model` is not the one served              |
    | 404    | invalid_request_error | unknown_url         | no route at that path                      |
    | 405    | invalid_request_error | method_not_allowed  | the route takes other methods (Allow)      |
    | 413    | invalid_request_error | request_too_large   | the body is past the server's size limit   |
    | 429    | rate_limit_error      | rate_limit_exceeded | too many requests waiting; retry later     |
    | 500    | server_error          | None                | a bug: the message says what failed        |
    | 503    | server_error          | service_unavailable | starting, draining, or the engine down     |

    The types and codes are OpenAI's where it has them (400, 401, 404; "server_error" for 5xx); the
    OpenAI clients choose their exception by status alone and retry 429 and 503 after Retry-After.
    A request that can never succeed is a 400, never a 429: a client must not retry it.
    """

    def __init__(self, status: int, message: str, type: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.retry_after_s = param, code, retry_after_s
        self._headers = headers or {}


    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    @property
    def headers(self) -> dict[str, str]:
        """Retry-After in whole seconds (HTTP's delay-seconds), rounded up so no client comes early;
        and any header the status needs (405's Allow)."""
        if self.retry_after_s is None:
            return dict(self._headers)
        return {**self._headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def unauthorized(cls) -> ApiError:
        return cls(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                   "invalid_request_error", code="invalid_api_key")

    @classmethod
    def model_not_found(cls, name: str, served: str | None = None) -> ApiError:
        hint = f"; this server serves {served!r}" if served else ""
        return cls(404, f"the model {name!r} does not exist{hint}", "invalid_request_error", "model",
                   "model_not_found")

    @classmethod
    def overloaded(cls, retry_after_s: float, message: str | None = None) -> ApiError:
        message = message or f"the server is at capacity; retry after {retry_after_s:g} s"
        return cls(429, message, "rate_limit_error", code="rate_limit_exceeded", retry_after_s=retry_after_s)

    @classmethod
    def unavailable(cls, retry_after_s: float, message: str | None = None) -> ApiError:
        message = message or f"the server is not ready to serve; retry after {retry_after_s:g} s"
        return cls(503, message, "server_error", code="service_unavailable", retry_after_s=retry_after_s)

    @classmethod
    def unknown_url(cls, method: str, path: str) -> ApiError:
        return cls(404, f"Invalid URL ({method} {path}): this server has no such route",
                   "invalid_request_error", code="unknown_url")

    @classmethod
    def method_not_allowed(cls, method: str, path: str, allow: str) -> ApiError:
        return cls(405, f"{path} does not take {method}; it takes {allow}", "invalid_request_error",
                   code="method_not_allowed", headers={"Allow": allow})

    @classmethod
    def too_large(cls, limit_bytes: int) -> ApiError:
        return cls(413, f"the request body is larger than this server's limit of {limit_bytes} bytes",
                   "invalid_request_error", code="request_too_large")

    @classmethod
    def internal(cls, message: str) -> ApiError:
        return cls(500, message, "server_error")

    @classmethod
    def from_validation(cls, error: ValidationError, rename: dict[str, str] | None = None) -> ApiError:
        """A 400 naming the first bad field (`param`: "messages[0].role", OpenAI's path spelling).

        `rename` maps a top-level field of the validated model to the request's name for it (the
        request's max_completion_tokens is SamplingParams' max_tokens).
        """
        first = error.errors(include_url=False)[0]
        loc = list(first["loc"])
        if loc and rename and loc[0] in rename:
            loc[0] = rename[loc[0]]
        param = param_path(loc)
        key = loc[-1] if loc else None
        if first["type"] == "extra_forbidden" and isinstance(key, str) and not key.isidentifier():
            parent = param_path(loc[:-1])  # a key no identifier: named as it was sent
            param = f"{parent}.{key}" if parent else key
        return cls.bad_request(_error_sentence(first, param), param)


def param_path(loc) -> str | None:
    """('messages', 0, 'role') -> "messages[0].role"; union member tags ("list[int]") are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier():
            path += f".{part}" if path else part
    return path or None


def _error_sentence(error: dict, param: str | None) -> str:
    kind, message = error["type"], error["msg"]
    if param is None:
        return "the request body must be a JSON object" if kind in ("model_type", "dict_type") else message
    if kind == "extra_forbidden":
        return f"{param}: unknown field; this server does not support it"
    if kind == "missing":
        return f"{param} is required"
    if kind == "value_error":  # our validators' own sentences, which start with the bare field name
        message = message.removeprefix("Value error, ")
        name = param.rsplit(".", 1)[-1].split("[", 1)[0]
        return param + message[len(name):] if message.startswith(name) else f"{param}: {message}"
    shown = _as_json(error.get("input"))
    got = f" (got {shown})" if len(shown) <= 40 else ""
    return f"{param}: {message[:1].lower()}{message[1:]}{got}"


def _as_json(value) -> str:
    """The value as the client wrote it (true, not True), where JSON can spell it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)

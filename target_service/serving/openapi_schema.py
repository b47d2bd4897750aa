"""The OpenAPI schema (`/openapi.json`, `/docs`): each body declared as the very model that parses it.

The routes read the JSON themselves (to apply the body limits first), so the schema is attached with
`openapi_extra`, and its components are those models' `model_json_schema()`, with the bounds only the
served model knows (`ServedLimits`, applied by `bound_by_served_model`): a completion prompt's token
ids lie in its vocabulary, 0..vocab_size - 1, and no request generates more than max_model_len - 1
tokens (a prompt has at least one). The server refuses what is past them with a 400 naming the field;
the tighter bound, max_model_len less the prompt's length, depends on the prompt and is not in a schema.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from target_service.serving.api_errors import ErrorResponse

_SCHEMA_REF = "#/components/schemas/{model}"

_ERROR_STATUSES = {400: "a bad field (named by param), or a request that can never succeed",
                   401: "a missing or wrong API key", 404: "no such model", 413: "the body is too large",
                   429: "at capacity; retry after Retry-After", 500: "a server fault",
                   503: "starting or shutting down; retry after Retry-After"}


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string",
    "description": "a stream chunk as JSON (the choices' increments; the usage last, when asked), an "
                   "ErrorResponse as JSON, or [DONE] last"}}}


def request_body(model: type[BaseModel]) -> dict:
    """A route's request body in the schema: `model` itself (its schema is in the components)."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def responses(model: type[BaseModel], *, stream: bool = True) -> dict:
    ok = {"model": model, "description": "the response" + (
        "; with stream true, server-sent events of its chunks, then `data: [DONE]`" if stream else "")}
    if stream:  # on OpenAPI 3.1 the schema of a text/event-stream is that of one event
        ok["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    errors = {status: {"model": ErrorResponse, "description": why} for status, why in _ERROR_STATUSES.items()}
    return {200: ok, **errors}


@dataclass(frozen=True)
class ServedLimits:
    vocab_size: int
    max_model_len: int


def openapi_schema(app: FastAPI, request_models, limits: ServedLimits | None = None) -> dict:
    """FastAPI's schema of the routes, with the request models' own schemas as components; given the
    served model's limits, with the fields they bound bounded."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, part in request_schemas(request_models).items():
            if components.get(name, part) != part:
                raise RuntimeError(f"two schemas are named {name} in the OpenAPI components")
            components[name] = part
        app.openapi_schema = schema
    if limits is None:
        return app.openapi_schema
    bounded = getattr(app.state, "bounded_openapi", None)
    if bounded is None or bounded[0] != limits:
        bounded = app.state.bounded_openapi = (limits, bound_by_served_model(app.openapi_schema, limits))
    return bounded[1]


PROMPT_TOKEN_IDS = "a token id of the served model's vocabulary, 0..{last}"
OUTPUT_TOKENS = ("at most the served model's context length less the prompt's tokens: never more than "
                 "{last}")
BOUNDED_OUTPUTS = {"CompletionRequest": ("max_tokens",),
                   "ChatCompletionRequest": ("max_tokens", "max_completion_tokens")}


def bound_by_served_model(schema: dict, limits: ServedLimits) -> dict:
    """A copy of `schema` in which every token id of a completion prompt is at most vocab_size - 1 and
    every output length at most max_model_len - 1."""
    bounded = copy.deepcopy(schema)
    models = bounded["components"]["schemas"]
    _bound(models["CompletionRequest"]["properties"]["prompt"], limits.vocab_size - 1, PROMPT_TOKEN_IDS)
    for model, fields in BOUNDED_OUTPUTS.items():
        for name in fields:
            _bound(models[model]["properties"][name], limits.max_model_len - 1, OUTPUT_TOKENS)
    return bounded


def _bound(schema: dict, last: int, description: str) -> None:
    for node in _integer_nodes(schema):
        node["maximum"] = last
        node["description"] = description.format(last=last)


def _integer_nodes(schema):
    """The integer schemas inside `schema`: the items of its arrays, the branches of its unions."""
    if schema.get("type") == "integer":
        yield schema
    for branch in schema.get("anyOf", ()):
        yield from _integer_nodes(branch)
    if isinstance(schema.get("items"), dict):
        yield from _integer_nodes(schema["items"])


def request_schemas(models) -> dict[str, dict]:
    """Each model's `model_json_schema()` and the models it nests, by name, with references into
    the OpenAPI components (where OpenAPI looks for them) instead of a `$defs` of their own."""
    schemas = {}
    for model in models:
        schema = model.model_json_schema(ref_template=_SCHEMA_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas

"""The OpenAPI schema (`/openapi.json`, `/docs`): each body declared as the very model that parses it.

The routes read the JSON themselves (to apply the body limits first), so the schema is attached with
`openapi_extra`, and its components are those models' `model_json_schema()`, with one bound only the
served model knows: a completion prompt's token ids lie in its vocabulary, 0..vocab_size - 1
(`bound_prompt_token_ids`; the engine refuses others with a 400 naming the range).
"""

from __future__ import annotations

import copy

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


def openapi_schema(app: FastAPI, request_models, vocab_size: int | None = None) -> dict:
    """FastAPI's schema of the routes, with the request models' own schemas as components; given the
    served model's `vocab_size`, with the prompt's token ids bounded by it."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, part in request_schemas(request_models).items():
            if components.get(name, part) != part:
                raise RuntimeError(f"two schemas are named {name} in the OpenAPI components")
            components[name] = part
        app.openapi_schema = schema
    if vocab_size is None:
        return app.openapi_schema
    bounded = getattr(app.state, "bounded_openapi", None)
    if bounded is None or bounded[0] != vocab_size:
        bounded = app.state.bounded_openapi = (vocab_size, bound_prompt_token_ids(app.openapi_schema,
                                                                                   vocab_size))
    return bounded[1]


PROMPT_TOKEN_IDS = "a token id of the served model's vocabulary, 0..{last}"


def bound_prompt_token_ids(schema: dict, vocab_size: int) -> dict:
    """A copy of `schema` in which every token id of a completion prompt is at most vocab_size - 1."""
    bounded = copy.deepcopy(schema)
    prompt = bounded["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    for node in _integer_nodes(prompt):
        node["maximum"] = vocab_size - 1
        node["description"] = PROMPT_TOKEN_IDS.format(last=vocab_size - 1)
    return bounded


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

"""The OpenAPI schema served at /openapi.json and /docs is generated from the pydantic models that
parse the requests, and true to them: each request body in it equals its model's
`model_json_schema()`; a body the schema allows is one the model accepts and the other way round
(on random bodies, valid and one mutation away); and random bodies made from the served schema, as
schemathesis makes them, never get a 5xx, always get a declared status, and every error is
OpenAI-shaped."""

import json

import jsonschema
import pytest
from fake_engine import EXPLODE, MAX_MODEL_LEN, assert_openai_error, call, demo_target_path, fake_app
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from json_schema_strategy import SchemaBodies

from target_service.serving.api_errors import ApiError
from target_service.serving.chat_request import ChatCompletionRequest
from target_service.serving.openai_protocol import CompletionRequest
from target_service.serving.openapi_schema import OUTPUT_TOKENS, request_schemas

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
REF = "#/components/schemas/{}"
# JSON Schema 2020-12's keywords (core, applicators, validation, metadata) the schema may use
JSON_SCHEMA_KEYWORDS = {
    "$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "if", "then", "else", "items", "prefixItems",
    "properties", "additionalProperties", "type", "enum", "const", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems",
    "maxItems", "required", "title", "description", "default", "format", "examples",
}
SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FAST = settings(deadline=None, database=None, suppress_health_check=SLOW_IS_FINE)


@pytest.fixture(scope="module")
def document():
    app, _ = fake_app()
    response = call(app, "GET", "/openapi.json")
    assert response.status_code == 200
    return response.json()


def inline(schema, root):
    """`schema` with every "#/..." reference replaced by what it points to in `root`."""
    if isinstance(schema, list):
        return [inline(part, root) for part in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return inline(target, root)
    return {key: inline(value, root) for key, value in schema.items() if key != "$defs"}


def subschemas(schema):
    """Every schema object inside `schema` (properties' values, items, the branches of anyOf, ...)."""
    yield schema
    for key in ("properties", "$defs"):
        for part in schema.get(key, {}).values():
            yield from subschemas(part)
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        for part in schema.get(key, []):
            yield from subschemas(part)
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(schema.get(key), dict):
            yield from subschemas(schema[key])


# ---- the schema is the models' ------------------------------------------------------------------


def test_openapi_and_docs_are_served_without_an_api_key():
    app, _ = fake_app(api_key="k")
    schema = call(app, "GET", "/openapi.json")
    assert schema.status_code == 200 and schema.json()["openapi"].startswith("3.1")
    docs = call(app, "GET", "/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text and "swagger" in docs.text.lower()
    refused = call(app, "POST", "/v1/completions", json={"prompt": "x"})
    assert_openai_error(refused, 401, code="invalid_api_key")


SERVED_BOUNDS = {CompletionRequest: ("prompt", "max_tokens"),
                 ChatCompletionRequest: ("max_tokens", "max_completion_tokens")}


def without_served_bounds(schema: dict, model) -> dict:
    """A served request schema with the fields the served model bounds as `model` writes them (the
    served ones: `test_the_served_model_s_limits_bound_token_ids_and_output_lengths`)."""
    schema = json.loads(json.dumps(schema))
    for name in SERVED_BOUNDS[model]:
        schema["properties"][name] = model.model_json_schema()["properties"][name]
    return schema


@pytest.mark.parametrize(("path", "model"), ROUTES.items())
def test_each_request_body_in_the_schema_is_its_model_s_json_schema(document, path, model):
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    served = body["content"]["application/json"]["schema"]
    assert served == {"$ref": REF.format(model.__name__)}
    own = model.model_json_schema()
    assert without_served_bounds(inline(served, document), model) == inline(own, own)
    components = document["components"]["schemas"]
    for name, part in request_schemas([model]).items():  # and verbatim, reference by reference
        assert (without_served_bounds(components[name], model) if name == model.__name__
                else components[name]) == part


def test_the_served_model_s_limits_bound_token_ids_and_output_lengths(document):
    """Only the served model knows its vocabulary and context length; the server refuses what is past
    them with a 400 (an id outside the vocabulary; more tokens than the context leaves)."""
    vocab_size = json.loads((demo_target_path() / "config.json").read_text())["vocab_size"]
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    token_ids = [branch["items"] for branch in prompt["anyOf"] if branch["type"] == "array"
                 and branch["items"].get("type") == "integer"]
    token_ids += [branch["items"]["items"] for branch in prompt["anyOf"] if branch["type"] == "array"
                  and branch["items"].get("type") == "array"]
    assert len(token_ids) == 2  # a prompt of ids; a batch of them
    for schema in token_ids:
        assert schema["minimum"] == 0 and schema["maximum"] == vocab_size - 1
        assert str(vocab_size - 1) in schema["description"]
    stop_ids = document["components"]["schemas"]["CompletionRequest"]["properties"]["stop_token_ids"]
    assert stop_ids == CompletionRequest.model_json_schema()["properties"]["stop_token_ids"]  # unbounded
    for model, fields in SERVED_BOUNDS.items():
        for name in fields[1:] if model is CompletionRequest else fields:
            field = document["components"]["schemas"][model.__name__]["properties"][name]
            [integer] = [branch for branch in field["anyOf"] if branch["type"] == "integer"]
            assert integer["maximum"] == MAX_MODEL_LEN - 1, (model.__name__, name)
    app, _ = fake_app()
    for max_tokens, status in ((MAX_MODEL_LEN, 400), (MAX_MODEL_LEN - 1, 200)):  # a 1-token prompt: the bound
        answer = call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": max_tokens})
        assert answer.status_code == status, (max_tokens, answer.text[:200])


@pytest.mark.parametrize("model", ROUTES.values())
def test_every_keyword_of_a_request_schema_is_json_schema_s(model):
    """pydantic writes a bound it cannot place as "ge"/"le", which JSON Schema ignores: none here."""
    for schema in subschemas(model.model_json_schema()):
        assert set(schema) <= JSON_SCHEMA_KEYWORDS, (set(schema) - JSON_SCHEMA_KEYWORDS, schema)


def test_the_schema_states_the_limits_and_the_strict_types(document):
    properties = inline(document["components"]["schemas"]["CompletionRequest"], document)["properties"]
    n = properties["n"]["anyOf"][0]
    assert n == {"type": "integer", "minimum": 1, "maximum": 128}
    assert properties["best_of"]["anyOf"] == [{"enum": [1]}, {"type": "null"}]  # refused unless 1
    assert properties["stream"]["anyOf"] == [{"type": "boolean"}, {"type": "null"}]
    last = MAX_MODEL_LEN - 1  # the served model's context bounds every output length
    assert properties["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": last,
                                                    "description": OUTPUT_TOKENS.format(last=last)}
    assert properties["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    echo_rule = {"if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
                 "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]}}
    assert echo_rule in document["components"]["schemas"]["CompletionRequest"]["allOf"]  # 0 only with echo
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["top_logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    assert properties["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}


def test_each_route_declares_its_answers(document):
    for path in ROUTES:
        responses = document["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        event = responses["200"]["content"]["text/event-stream"]["schema"]  # one event, on OpenAPI 3.1
        assert event["type"] == "object" and event["required"] == ["data"]
        error = responses["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": REF.format("ErrorResponse")}


# ---- true to the models: the schema allows exactly what the model accepts -----------------------


def accepts(model, body) -> bool:
    try:
        model.from_body(body)
    except ApiError as error:
        assert error.status == 400
        return False
    return True


def max_tokens_disagree(body) -> bool:
    """The one rule the schema cannot state (it compares two fields)."""
    return (isinstance(body, dict) and body.get("max_tokens") is not None
            and body.get("max_completion_tokens") is not None
            and body["max_tokens"] != body["max_completion_tokens"])


STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def tools_disagree(body) -> bool:
    """The tools' rules the schema cannot state (they compare fields, or items of a list): a name given
    twice, a tool_choice that asks for a call without tools or names one that is not there, and forced
    calls beside another structured output. A mutated body may give a field the wrong type (tools
    true); the schema rejects that one itself, so it is no disagreement."""
    if not isinstance(body, dict) or not isinstance(body.get("tools") or [], list):
        return False
    functions = [tool.get("function") for tool in body.get("tools") or [] if isinstance(tool, dict)]
    names = [function["name"] for function in functions if isinstance(function, dict) and "name" in function]
    choice = body.get("tool_choice")
    forcing = choice == "required" or isinstance(choice, dict)
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    response_format = body.get("response_format")
    structured = any(body.get(name) is not None for name in STRUCTURED_FIELDS) or (
        isinstance(response_format, dict) and response_format.get("type") != "text")
    return (len(names) != len(set(map(str, names))) or (forcing and not names)
            or (named is not None and named not in names) or (forcing and bool(names) and structured))


@pytest.mark.parametrize(("path", "model"), ROUTES.items())
def test_a_body_the_schema_allows_is_one_the_model_accepts_and_the_other_way_round(document, path, model):
    """Against the model's own bounds: the served ones (an output length past the served context, an id
    past its vocabulary) are the server's to refuse, after the model parsed the body, and
    `test_the_served_model_s_limits_bound_token_ids_and_output_lengths` checks those (a draw of max_tokens
    64 against a served bound of 63 broke this test in a clean-clone run)."""
    own = json.loads(json.dumps(document))
    schemas = own["components"]["schemas"]
    schemas[model.__name__] = without_served_bounds(schemas[model.__name__], model)
    bodies = SchemaBodies(own)
    ref = REF.format(model.__name__)
    validator = bodies.validator(ref)

    @settings(FAST, max_examples=300)
    @given(st.one_of(bodies.valid_bodies(ref), bodies.mutated_bodies(ref)))
    def agree(body):
        if max_tokens_disagree(body) or (model is ChatCompletionRequest and tools_disagree(body)):
            assert not accepts(model, body)
            return
        assert validator.is_valid(body) == accepts(model, body), body

    agree()


# ---- schemathesis-style: random bodies from the served schema never get a 5xx -------------------


@pytest.mark.parametrize("path", ROUTES)
def test_random_bodies_from_the_served_schema_never_get_a_5xx(document, path):
    bodies = SchemaBodies(document)
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    responses = document["paths"][path]["post"]["responses"]
    answer_schema = responses["200"]["content"]["application/json"]["schema"]
    answer = jsonschema.Draft202012Validator({**answer_schema, "components": document["components"]})
    error = jsonschema.Draft202012Validator({"$ref": REF.format("ErrorResponse"),
                                             "components": document["components"]})
    app, _ = fake_app()
    valid = bodies.valid_bodies(ref).map(served_model)

    @settings(FAST, max_examples=250)
    @given(st.one_of(valid, bodies.mutated_bodies(ref)))
    def never_5xx(body):
        response = call(app, "POST", path, content=json.dumps(body))
        event(f"status {response.status_code}")  # the mix, with --hypothesis-show-statistics
        assert response.status_code < 500, (body, response.text[:300])
        assert str(response.status_code) in responses, (body, response.status_code)
        if response.status_code != 200:
            assert error.is_valid(response.json()), response.text[:300]
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]
            assert events[-1] == "[DONE]" and all(json.loads(event) for event in events[:-1])
        else:
            assert answer.is_valid(response.json()), response.text[:300]

    never_5xx()


def served_model(body):
    """Most generated bodies name a random model (404): half of them get the served one, so the
    rest of the body is exercised too."""
    if isinstance(body, dict) and hash(json.dumps(body, sort_keys=True)) % 2:
        return {**body, "model": "fake"}
    return body


def test_a_body_the_server_fails_on_is_an_openai_shaped_500_not_plain_text():
    app, _ = fake_app()
    for stream in (False, True):
        response = call(app, "POST", "/v1/completions", json={"prompt": EXPLODE, "stream": stream})
        error = assert_openai_error(response, 500)
        assert "RuntimeError" in error["message"]

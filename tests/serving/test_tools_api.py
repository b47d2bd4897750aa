"""Tools on /v1/chat/completions, on the demo pair served in process (its template does not render
tools, so the calls here are the forced ones): tool_choice "required" and a named function answer
with tool_calls whose arguments are JSON matching the tool's schema (checked with jsonschema),
finish_reason "tool_calls" and no content, streamed as the same calls; "none" and "auto" answer
text; a history with an assistant's calls and the tool's answer is rendered; every bad tools field
is a 400 naming it, before anything is queued."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from demo_app import demo_app
from demo_app import post as post_to

WEATHER_ARGUMENTS = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                     "properties": {"city": {"type": "string", "maxLength": 16},
                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": WEATHER_ARGUMENTS}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "def weather(city):\n    return "}]


@pytest.fixture(scope="module")
def served():
    with demo_app() as served:
        yield served


def post(app, body: dict) -> httpx.Response:
    return post_to(app, "/v1/chat/completions", body)


def streamed(app, body: dict) -> tuple[str, list[dict], str]:
    response = post(app, {**body, "stream": True})
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    content = "".join(chunk["delta"].get("content") or "" for chunk in chunks)
    calls = [call for chunk in chunks for call in chunk["delta"].get("tool_calls") or []]
    return content, calls, chunks[-1]["finish_reason"]


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "now"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
])
def test_a_forced_call_matches_its_tool_streamed_or_not(served, choice, names):
    _, app = served
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": choice, "max_tokens": 200,
            "temperature": 0, "parallel_tool_calls": False}
    response = post(app, body)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    calls = answer["message"]["tool_calls"]
    assert len(calls) == 1
    assert_valid_calls(calls, names)
    content, stream_calls, reason = streamed(app, body)
    assert reason == "tool_calls" and content == ""
    assert [(c["index"], c["function"]) for c in stream_calls] == [(0, c["function"]) for c in calls]


def test_none_and_auto_answer_text(served):
    _, app = served
    for choice in ("none", "auto"):
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 16,
                "temperature": 0}
        answer = post(app, body).json()["choices"][0]
        assert answer["message"]["content"] and answer["message"]["tool_calls"] is None
        assert answer["finish_reason"] in ("stop", "length")


def test_a_history_with_calls_and_their_answers_is_rendered(served):
    _, app = served
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}]
    response = post(app, {"messages": messages, "tools": [WEATHER], "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("fields,field,message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "tools is empty or missing"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name",
     "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}],
      "tool_choice": "required"}, "tools", "does not compile"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "null only in an assistant message"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]",
     "only an assistant message has tool calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     "function.arguments is not JSON"),
])
def test_a_bad_tools_field_is_a_400_naming_it_and_nothing_is_queued(served, fields, field, message):
    replica, app = served
    response = post(app, {"messages": ASK, "max_tokens": 8, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and message in error["message"] and "\n" not in error["message"], error
    assert replica.assembly.engine.num_requests == 0

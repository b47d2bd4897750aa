"""Structured outputs over HTTP, on the demo pair served in process: response_format (json_object,
json_schema), vLLM's structured_outputs and guided_* on completions and chat, streamed or not; each
answer matches its spec by a check without llguidance (json + jsonschema, re), equals the offline
engine's constrained output for the same request, and a stream joins to the whole answer. Refused
with a 400 naming the field, before anything is queued, while another request runs on: a spec that
does not compile, two specs at once, a malformed one."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from demo_app import DEMO_ARGS, demo_app, post
from grammar_helpers import assert_matches

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.structured.params import StructuredOutputsParams

ARGS = {**DEMO_ARGS, "max_model_len": 384}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}
PROMPTS = ["def parse_args(argv):\n    ", "class Config:\n    ", "import json\n\ndata = "]


@pytest.fixture(scope="module")
def served():
    with demo_app(**ARGS) as served:
        yield served


def streamed_text(app, path: str, body: dict) -> str:
    response = post(app, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    if path.endswith("chat/completions"):
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def text_of(response: httpx.Response, chat: bool) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"], choice["finish_reason"]


def offline(prompt: str, spec: StructuredOutputsParams, max_tokens: int) -> str:
    llm = LLM(**{key: value for key, value in ARGS.items() if key != "admin_port"})
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=spec)
        return llm.generate([prompt], params)[0].outputs[0].text
    finally:
        llm.close()


CASES = {
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}}, StructuredOutputsParams(json=SCHEMA)),
    "response_format json_object": ({"response_format": {"type": "json_object"}},
                                    StructuredOutputsParams(json_object=True)),
    "guided_regex": ({"guided_regex": r"[a-z]{2,6}-[0-9]{2}"},
                     StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{2}")),
    "guided_choice": ({"guided_choice": ["alpha", "beta", "gamma"]},
                      StructuredOutputsParams(choice=["alpha", "beta", "gamma"])),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": 'start: "x = " /[0-9]{1,3}/'}},
                                   StructuredOutputsParams(grammar='start: "x = " /[0-9]{1,3}/')),
}


GRAMMAR_REGEX = r"x = [0-9]{1,3}"  # the structured_outputs grammar's language


@pytest.mark.parametrize("name", list(CASES))
def test_completions_match_their_spec_and_the_offline_engine(served, name):
    _, app = served
    fields, spec = CASES[name]
    stopped = 0
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 120, "temperature": 0, **fields}
        text, finish_reason = text_of(post(app, "/v1/completions", body), chat=False)
        assert finish_reason in ("stop", "length")
        assert_matches(spec, text, finish_reason, GRAMMAR_REGEX)
        assert text == offline(prompt, spec, 120)
        assert streamed_text(app, "/v1/completions", body) == text
        stopped += finish_reason == "stop"
    assert stopped, "every answer ran to max_tokens: nothing was checked against the spec"


@pytest.mark.parametrize("name", ["response_format json_schema", "guided_choice"])
def test_chat_matches_its_spec_streamed_or_not(served, name):
    _, app = served
    fields, spec = CASES[name]
    body = {"messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": 120,
            "temperature": 0, **fields}
    text, finish_reason = text_of(post(app, "/v1/chat/completions", body), chat=True)
    assert finish_reason in ("stop", "length")
    assert_matches(spec, text, finish_reason, GRAMMAR_REGEX)
    assert streamed_text(app, "/v1/chat/completions", body) == text


@pytest.mark.parametrize("fields,field,message", [
    ({"guided_regex": "(["}, "guided_regex", "the regex does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "the json does not compile"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "does not compile"),
    ({"guided_grammar": ""}, "guided_grammar", "No 'root' rule found"),  # schemathesis found it a 500
    ({"guided_grammar": "root ::= item"}, "guided_grammar", "Rule 'item' not found"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex", "give one of"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "exactly one of json, json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs", "choice.1: String should have"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: Field required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be one of"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: list should have at least 1 item"),
    ({"guided_regex": "a" * 70_000}, "guided_regex", "at most 65536 characters"),
])
def test_a_bad_spec_is_a_400_naming_its_field_and_hurts_no_other_request(served, fields, field, message):
    replica, app = served
    good = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as http:
            running = asyncio.ensure_future(http.post("/v1/completions", json=good))
            bad = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, **fields})
            return bad, await running

    bad, running = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == field and message in error["message"] and "\n" not in error["message"]
    assert running.status_code == 200 and running.json()["usage"]["completion_tokens"] == 24
    assert replica.assembly.engine.num_requests == 0

"""The openai client's own structured outputs against the demo pair served in process: a Pydantic
model as `response_format` and a Pydantic function tool with a named `tool_choice` (the client writes
the strict schemas and parses the answers) validate every time, over many seeds at temperature 1,
where the same requests without them do not; and greedy constrained output is the same with the
drafter and without it."""

from __future__ import annotations

import asyncio
import random
from typing import Literal

import openai
import pytest
from asgi_openai import client
from demo_app import demo_app
from pydantic import BaseModel, Field, ValidationError

SEEDS = 6
MODEL = "dflash-demo"


class Signature(BaseModel):
    name: str = Field(max_length=16)
    args: list[str] = Field(max_length=3)
    returns: Literal["int", "str", "list", "None"]
    pure: bool


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def served():
    with demo_app() as (_, app):
        yield app


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_pydantic_response_format_parses_every_time(served):
    prompt = random.choice(["def parse(path):\n    ", "class Stack:\n    def push(self, item):\n"])

    async def main():
        api = client(served)
        parsed = await asyncio.gather(*(api.chat.completions.parse(
            model=MODEL, messages=ask(prompt), response_format=Signature, temperature=1.0, seed=seed,
            max_tokens=160) for seed in range(SEEDS)))
        free = await asyncio.gather(*(api.chat.completions.create(
            model=MODEL, messages=ask(prompt), temperature=1.0, seed=seed, max_tokens=160)
            for seed in range(SEEDS)))
        return parsed, free

    parsed, free = asyncio.run(main())
    for answer in parsed:
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "stop" and isinstance(message.parsed, Signature)
        assert Signature.model_validate_json(message.content) == message.parsed
    unconstrained = []
    for answer in free:
        try:
            Signature.model_validate_json(answer.choices[0].message.content)
            unconstrained.append(True)
        except ValidationError:
            unconstrained.append(False)
    assert not all(unconstrained), "the demo's free output parses anyway: the test shows nothing"


def test_a_named_pydantic_tool_is_called_with_valid_arguments_every_time(served):
    tool = openai.pydantic_function_tool(GetWeather)

    async def main():
        api = client(served)
        return await asyncio.gather(*(api.chat.completions.parse(
            model=MODEL, messages=ask("def weather(city):\n    "), tools=[tool],
            tool_choice={"type": "function", "function": {"name": "GetWeather"}}, parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=160) for seed in range(SEEDS)))

    for answer in asyncio.run(main()):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_greedy_constrained_output_is_the_same_with_and_without_the_drafter(served):
    with demo_app(drafter="none") as (_, plain):
        async def answer(app):
            result = await client(app).chat.completions.parse(
                model=MODEL, messages=ask("import os\n\ndef walk(root):\n    "), response_format=Signature,
                temperature=0, max_tokens=160)
            return result.choices[0].message.content

        assert asyncio.run(answer(served)) == asyncio.run(answer(plain))

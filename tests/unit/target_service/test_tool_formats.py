"""Tool-call formats: a stream cut anywhere reads back as the whole text does (content and calls),
a call that does not parse stays content, and the grammar that forces calls accepts exactly the
calls its tools allow (checked on a real byte-level tokenizer)."""

from __future__ import annotations

import json
import random

import pytest
from grammar_helpers import EOS, write_byte_tokenizer
from tokenizers import Tokenizer

from target_service.serving.tool_formats import HERMES, LLAMA3_JSON, ToolCallSplitter, assistant_message
from target_service.structured.params import StructuredOutputsParams
from target_service.structured.vocabulary import GrammarVocabulary

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}
CLOCK = {"name": "now", "parameters": None}


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def in_pieces(splitter: ToolCallSplitter, text: str, rng: random.Random):
    content, calls, at = "", [], 0
    while at < len(text):
        end = min(len(text), at + rng.randint(1, 7))
        more, new = splitter.feed(text[at:end], final=end == len(text))
        content, calls, at = content + more, calls + new, end
    return content, calls


@pytest.mark.parametrize("fmt,text", [
    (HERMES, "Checking. " + hermes_call("get_weather", {"city": "Paris"}) + "\n" + hermes_call("now", {})),
    (HERMES, "no calls here, only a < and a <tool and <tool_call without its end"),
    (HERMES, "<tool_call>\nnot json\n</tool_call> then " + hermes_call("now", {})),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "a;b"}}; '
                  '{"name": "now", "parameters": {}}'),
    (LLAMA3_JSON, "Plain words {with braces}"),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": '),
])
def test_a_stream_cut_anywhere_reads_as_the_whole_text(fmt, text):
    rng = random.Random()
    whole_content, whole_calls = ToolCallSplitter(fmt).feed(text, final=True)
    for _ in range(20):
        content, calls = in_pieces(ToolCallSplitter(fmt), text, rng)
        assert content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    if "not json" in text:
        assert "not json" in whole_content and [c.name for c in whole_calls] == ["now"]


def test_a_whole_answer_with_calls_has_null_content_and_finishes_with_tool_calls():
    message, reason = assistant_message(HERMES, hermes_call("now", {}), "stop")
    assert message.content is None and reason == "tool_calls"
    assert message.tool_calls[0].function.name == "now" and message.tool_calls[0].function.arguments == "{}"
    message, reason = assistant_message(HERMES, "just text", "stop")
    assert message.content == "just text" and message.tool_calls is None and reason == "stop"
    _, reason = assistant_message(HERMES, hermes_call("now", {}), "length")
    assert reason == "length"  # cut short: not a finished call


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(directory, 320)
    return GrammarVocabulary(Tokenizer.from_file(str(directory / "tokenizer.json")), [EOS], 320), directory


def accepts(vocabulary, grammar: str, text: str) -> bool:
    vocab, directory = vocabulary
    constraint = vocab.constraint(StructuredOutputsParams(grammar=grammar))
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids
    return all(constraint.advance(token) for token in ids) and constraint.matcher.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_the_forcing_grammar_takes_the_tools_calls_and_nothing_else(vocabulary, fmt):
    key = fmt.arguments_key

    def call(name, arguments):
        body = json.dumps({"name": name, key: arguments})
        return f"{fmt.opening}{body}{fmt.closing}" if fmt.closing else body

    one = fmt.grammar([WEATHER, CLOCK], parallel=False)
    assert accepts(vocabulary, one, call("get_weather", {"city": "Oslo", "days": 3}))
    assert accepts(vocabulary, one, call("now", {}))
    assert not accepts(vocabulary, one, call("get_weather", {"days": 3}))  # city is required
    assert not accepts(vocabulary, one, call("get_weather", {"city": "Oslo", "extra": 1}))
    assert not accepts(vocabulary, one, call("delete_everything", {}))
    assert not accepts(vocabulary, one, call("now", {}) + fmt.separator + call("now", {}))
    many = fmt.grammar([WEATHER, CLOCK], parallel=True)
    assert accepts(vocabulary, many, call("now", {}) + fmt.separator + call("get_weather", {"city": "x"}))
    named = fmt.grammar([CLOCK], parallel=False)
    assert not accepts(vocabulary, named, call("get_weather", {"city": "Oslo"}))

"""How a model family writes its tool calls: the grammar that forces one, and reading them back.

Two formats, chosen by the target's `model_type`:
- `hermes` (Qwen2.5, Qwen3 and the Hermes family): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the text;
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, calls
  separated by `; `.

`ToolCallSplitter` reads the text as it streams: text outside calls goes on as content at once
(holding back only what may still become a call's opening), and each call is handed out whole once
its closing arrives. A whole response is the same splitter fed all the text at once, so a stream's
content and calls are exactly the response's. A call that does not parse (unterminated, not JSON,
no name) stays content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from target_service.serving.openai_responses import AssistantMessage
from target_service.serving.tool_protocol import FunctionCall, ToolCall
from target_service.structured.params import JSON_OPTIONS


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opening: str  # where a call starts
    closing: str | None  # where it ends (None: at the end of the output)
    arguments_key: str
    separator: str  # between calls, in the grammar

    def call_schema(self, functions: list[dict]) -> dict:
        """The JSON of one call to any of `functions` ({"name", "parameters"} dicts)."""
        choices = [{"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": function["name"]},
                                   self.arguments_key: function.get("parameters") or {"type": "object"}}}
                   for function in functions]
        schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
        return {**schema, "x-guidance": JSON_OPTIONS}

    def grammar(self, functions: list[dict], *, parallel: bool) -> str:
        """A Lark grammar (llguidance's) of one call, or with `parallel` one or more, to `functions`."""
        body = f"%json {json.dumps(self.call_schema(functions))}"
        if self.closing is None:
            call = f"call: {body}"
        else:
            call = f"call: {json.dumps(self.opening)} {body} {json.dumps(self.closing)}"
        start = f"start: call ({json.dumps(self.separator)} call)*" if parallel else "start: call"
        return f"{start}\n{call}\n"

    def parse_call(self, text: str) -> ParsedCall | None:
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get(self.arguments_key, call.get("arguments", {}))
        return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3_JSON = ToolFormat("llama3_json", "{", None, "parameters", "; ")
BY_MODEL_TYPE = {"llama": LLAMA3_JSON}


def tool_format(model_type: str | None) -> ToolFormat:
    return BY_MODEL_TYPE.get(model_type or "", HERMES)


class ToolCallSplitter:
    """One choice's text, as it streams, into content and whole calls."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.pending = ""  # text not handed out yet
        self.num_calls = 0
        self._whole = "undecided"  # llama3_json: "calls" (the output began as one) or "text" once seen

    def feed(self, text: str, *, final: bool) -> tuple[str, list[ParsedCall]]:
        """(content, calls) to hand out now for the new `text`; `final`: the output is complete."""
        self.pending += text
        if self.fmt.closing is None:
            return self._feed_whole_output(final)
        content, calls = "", []
        while True:
            start = self.pending.find(self.fmt.opening.strip())
            if start < 0:
                keep = 0 if final else _held_back(self.pending, self.fmt.opening.strip())
                content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return content, calls
            end = self.pending.find(self.fmt.closing.strip(), start)
            if end < 0:
                content += self.pending[:start]
                self.pending = self.pending[start:]
                if final:
                    content, self.pending = content + self.pending, ""
                return content, calls
            inner = self.pending[start + len(self.fmt.opening.strip()): end]
            call = self.fmt.parse_call(inner)
            stop = end + len(self.fmt.closing.strip())
            if call is None:
                content += self.pending[:stop]
            else:
                content += self.pending[:start]
                calls.append(call)
                self.num_calls += 1
            self.pending = self.pending[stop:]

    def _feed_whole_output(self, final: bool) -> tuple[str, list[ParsedCall]]:
        """llama3_json: an output that begins with "{" is held until it ends, then read as calls;
        any other is content as it comes."""
        if self._whole == "undecided":
            stripped = self.pending.lstrip()
            if not stripped and not final:
                return "", []
            self._whole = "calls" if stripped.startswith(self.fmt.opening) else "text"
        if self._whole == "text" or final:
            text, self.pending = self.pending, ""
            values = _json_values(text) if self._whole == "calls" else []
            calls = [self.fmt.parse_call(part) for part in values]
            if calls and all(call is not None for call in calls):
                self.num_calls = len(calls)
                return "", calls
            return text, []
        return "", []


def assistant_message(fmt: ToolFormat | None, text: str, finish_reason: str | None):
    """(AssistantMessage, finish_reason) of a whole chat choice: with tools, its calls read out of
    the text (content null when nothing else was said) and finish_reason "tool_calls" for a choice
    that stopped with calls."""
    if fmt is None:
        return AssistantMessage(content=text), finish_reason
    content, calls = ToolCallSplitter(fmt).feed(text, final=True)
    if not calls:
        return AssistantMessage(content=content), finish_reason
    tool_calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                  for call in calls]
    message = AssistantMessage(content=content if content.strip() else None, tool_calls=tool_calls)
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def model_type_of(target_dir: Path) -> str | None:
    """The checkpoint's `model_type` (config.json), which picks its tool-call format."""
    try:
        return json.loads((Path(target_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _json_values(text: str) -> list[str]:
    """The JSON texts of `text` written one after another, separated by blanks or ";" ([]: not so)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return []
        values.append(text[at:end])
        at = end


def _held_back(text: str, opening: str) -> int:
    """The longest end of `text` that is a beginning of `opening` (it may still become one)."""
    longest = min(len(text), len(opening) - 1)
    return next((n for n in range(longest, 0, -1) if opening.startswith(text[-n:])), 0)

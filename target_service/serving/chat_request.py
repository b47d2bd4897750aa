"""POST /v1/chat/completions' request body: the messages (OpenAI's roles, text parts, an assistant's
tool calls) and the chat-only fields, over the sampling fields both endpoints share
(`openai_protocol.SamplingRequest`). Tools: `tool_protocol`; structured outputs:
`structured_fields`."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from target_service.engine.sampling_params import MAX_LOGPROBS
from target_service.serving.api_errors import ApiError
from target_service.serving.openai_protocol import SamplingRequest, integer, sampling_range
from target_service.serving.tool_protocol import MAX_TOOLS, ToolCall, ToolFields, ToolRefusal


class TextPart(BaseModel):
    """One of OpenAI's content parts, the only kind this server takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


def _message_schema(schema: dict) -> None:
    """The validator's rules in the JSON schema too: only an assistant has tool_calls, and a null
    content needs them."""
    calls = {"type": "array", "minItems": 1}
    schema["allOf"] = [
        {"if": {"properties": {"tool_calls": {"type": "array"}}, "required": ["tool_calls"]},
         "then": {"properties": {"role": {"const": "assistant"}}}},
        {"if": {"properties": {"content": {"type": "null"}}, "required": ["content"]},
         "then": {"required": ["role", "tool_calls"],
                  "properties": {"role": {"const": "assistant"}, "tool_calls": calls}}},
    ]


class ChatMessage(BaseModel):
    """One message; content as a string or OpenAI's text parts, joined by newlines (as vLLM does):
    once validated, `content` is always the string (or null, in an assistant's tool calls)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_message_schema)

    # developer: OpenAI's newer name for system, rendered as system; tool: a tool's result, rendered
    # where the chat template renders tool messages (else a 400 names the template)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None  # null only in an assistant message with tool_calls
    name: str | None = None  # the speaker's name, handed to the template (most ignore it)
    tool_call_id: str | None = None  # the call a tool message answers
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's

    def for_template(self) -> dict:
        """The message as chat templates read it: developer as system, no empty optional keys (a
        template testing `'name' in message` sees only names that were given), a null content as ""
        and the calls' arguments as objects (transformers' convention)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        optional = (("name", self.name), ("tool_call_id", self.tool_call_id))
        message.update({key: value for key, value in optional if value is not None})
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message

    @model_validator(mode="after")
    def _calls_only_from_the_assistant(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: null only in an assistant message with tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        """Parts joined here, before the union, so a bad content is one sentence naming it."""
        if value is None:
            return None
        if isinstance(value, list) and all(
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                and len(part) == 2 for part in value):
            return "\n".join(part["text"] for part in value)
        if isinstance(value, str):
            return value
        raise ValueError('content must be a string or a list of {"type": "text", "text": ...} parts')


class ChatCompletionRequest(SamplingRequest, ToolFields):
    """POST /v1/chat/completions. max_completion_tokens (OpenAI's newer name) wins over max_tokens.
    Tools: `tool_protocol`."""

    _implications: ClassVar[list[tuple[str, dict, str]]] = [
        *SamplingRequest._implications, ("top_logprobs", {"type": "integer", "minimum": 1}, "logprobs")]
    _prompt_field: ClassVar[str] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: sampling_range("max_tokens") | None = None
    max_completion_tokens: sampling_range("max_tokens") | None = None
    logprobs: bool | None = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: bool = True  # vLLM

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _logprob_fields(self) -> dict:
        return {"logprobs": self.num_logprobs}

    @classmethod
    def from_body(cls, body: Any):
        request = super().from_body(body)
        try:
            request.check_tools()
        except ToolRefusal as error:
            raise ApiError.bad_request(str(error), error.field) from None
        if request.forced_functions is not None and request.structured_field is not None:
            raise ApiError.bad_request(f"tool_choice {request.tool_choice_name} forces tool calls; it cannot "
                                       f"be combined with {request.structured_field}", "tool_choice")
        return request

    @property
    def grammar_field(self) -> str | None:
        """The field a grammar that does not compile came from: a structured output's, or the tools'
        (the forced calls' parameters)."""
        return self.structured_field or ("tools" if self.forced_functions is not None else None)

    @property
    def tool_choice_name(self) -> str:
        choice = self.tool_choice
        return choice if isinstance(choice, str) else f"function {choice.function.name!r}"

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value):
        if value == []:
            raise ValueError("messages is empty; give at least one message")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_max(cls, value, info):
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_completion_tokens is {value} but max_tokens is {other}; give one of them")
        return value

    def _max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

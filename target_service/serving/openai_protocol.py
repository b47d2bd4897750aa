"""The OpenAI-compatible API as vLLM serves it: request, response and error bodies, engine-free.

The HTTP layer parses a body with `CompletionRequest.from_body` / `ChatCompletionRequest.from_body`,
turns it into one `SamplingParams` per choice with `to_sampling_params`, and answers with the
response models below; every refusal is an `ApiError`, which carries its status, headers and
OpenAI-shaped body. Field names are the API's own (OpenAI's; vLLM's for the extensions top_k,
ignore_eos, stop_token_ids and add_generation_prompt), so `model_dump()` is the wire format.

A field OpenAI defines but this server does not implement (echo, logprobs, best_of, suffix, the
penalties, logit_bias) is refused by name when set to anything but its no-op value, never dropped:
a client that asked for logprobs must learn it got none. `user` is accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, field_validator

from target_service.engine.sampling_params import SamplingParams
from target_service.serving.api_errors import ApiError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# ---- requests -----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _SamplingRequest(BaseModel):
    """The fields both endpoints share, and the rule that turns them into `SamplingParams`.

    A null is the field's default. Ranges (max_tokens >= 1, temperature >= 0, 0 < top_p <= 1, top_k)
    are SamplingParams' to check (`from_body` and `to_sampling_params` ask it); this model checks
    types and the request-only fields (n, seed, stream_options and the refused no-op fields).
    """

    model_config = ConfigDict(extra="forbid")

    # field -> the values that ask for nothing this server lacks (None always does)
    _no_op: ClassVar[dict[str, tuple]] = {"frequency_penalty": (0,), "presence_penalty": (0,),
                                          "logit_bias": ({},)}
    _prompt_field: ClassVar[str]

    model: str | None = None  # None: the served model
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1  # vLLM: -1 (or 0, or null) is off
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM
    n: int | None = Field(1, ge=1)
    ignore_eos: bool | None = False  # vLLM
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    @classmethod
    def from_body(cls, body: Any):
        """The parsed request, or ApiError 400 naming the first bad field, ranges included: every
        refusal but the context length's comes here, before the prompt is rendered or tokenized."""
        try:
            request = cls.model_validate(body)
        except ValidationError as error:
            raise ApiError.from_validation(error) from None
        requested = request._max_tokens_field()[1]
        request._sampling_params(1 if requested is None else requested)
        return request

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value, info):
        accepted = cls._no_op.get(info.field_name)
        if accepted is not None and value is not None and value not in accepted:
            raise ValueError(f"{info.field_name}={json.dumps(value)} is not supported by this server; "
                             "leave it unset")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(text, str) for text in value)):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """A streamed request's last chunk carries the usage (and no choices)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _max_tokens_field(self) -> tuple[str, int | None]:
        raise NotImplementedError

    def to_sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> list[SamplingParams]:
        """One SamplingParams per choice (n of them) for a prompt of `num_prompt_tokens` tokens.

        A null max_tokens (chat's default) is what fits: max_model_len - num_prompt_tokens. Asking for
        more than fits is refused, as vLLM does. With a seed, choice i gets seed + i (vLLM's rule),
        so the n choices differ yet the request stays reproducible.
        """
        name, requested = self._max_tokens_field()
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise ApiError.bad_request(
                f"{self._prompt_field}: the prompt has {num_prompt_tokens} tokens and this model's maximum "
                f"context length is {max_model_len}: no room is left to generate", self._prompt_field)
        params = self._sampling_params(room if requested is None else requested)
        if params.max_tokens > room:
            raise ApiError.bad_request(
                f"{name} is {params.max_tokens}, but this model's maximum context length is {max_model_len} "
                f"tokens and the prompt has {num_prompt_tokens}: at most {room} can be generated", name)
        n = self.n or 1
        if self.seed is None:
            return [params] * n
        return [params.model_copy(update={"seed": self.seed + i}) for i in range(n)]

    def _sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams checks the ranges, once; its refusal names the request's field."""
        fields = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k in (None, 0) else self.top_k,
            "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": bool(self.ignore_eos),
        }
        try:
            return SamplingParams(**fields)
        except ValidationError as error:
            name = self._max_tokens_field()[0]
            raise ApiError.from_validation(error, rename={"max_tokens": name}) from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. Choice index i * n + j is prompt i's choice j (vLLM's order)."""

    _no_op: ClassVar[dict[str, tuple]] = {**_SamplingRequest._no_op, "echo": (False,), "logprobs": (),
                                          "best_of": (1,), "suffix": ("",)}
    _prompt_field: ClassVar[str] = "prompt"

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        if value == [] or value == [[]]:
            raise ValueError("prompt is empty")
        if isinstance(value, str) or _is_token_ids(value):
            return value
        if isinstance(value, list) and (all(isinstance(p, str) for p in value)
                                        or all(_is_token_ids(p) and p for p in value)):
            return value
        raise ValueError("prompt must be a string, a list of token ids, or a list of either")

    def prompts(self) -> list[str | list[int]]:
        """The batch: a single string or a single token list is a batch of one."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def _max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


class ChatMessage(BaseModel):
    """One message; content as a string or OpenAI's text parts, joined by newlines (as vLLM does)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if isinstance(value, list) and all(
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                and len(part) == 2 for part in value):
            return "\n".join(part["text"] for part in value)
        if isinstance(value, str):
            return value
        raise ValueError('content must be a string or a list of {"type": "text", "text": ...} parts')


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. max_completion_tokens (OpenAI's newer name) wins over max_tokens."""

    _no_op: ClassVar[dict[str, tuple]] = {**_SamplingRequest._no_op, "logprobs": (False,),
                                          "top_logprobs": (0,)}
    _prompt_field: ClassVar[str] = "messages"

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM

    @field_validator("messages")
    @classmethod
    def _messages(cls, value):
        if not value:
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


# ---- responses ----------------------------------------------------------------------------------

# The engine's reasons. "abort" (the request was cancelled) is vLLM's: the openai package's types
# lack it, and its client, which does not validate by default, passes it through as a string.
FinishReason = Literal["stop", "length", "abort"] | None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @computed_field
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class CompletionChoice(BaseModel):
    """One choice of a response, or its increment in a stream chunk (finish_reason null until the last)."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChunk(BaseModel):
    """One SSE event of a streamed completion; every chunk of a stream repeats its id and created."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with no choices, when include_usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A choice's increment: the first chunk carries role "assistant", later ones content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionStreamChunk(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with no choices, when include_usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dflash-serve"
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- server-sent events -------------------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"  # the OpenAI stream's last event


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk` as JSON (a stream chunk, or an ErrorResponse mid-stream)."""
    return f"data: {chunk.model_dump_json()}\n\n"

"""The OpenAI-compatible API's response bodies as vLLM serves them: whole responses, stream chunks,
the model list, and the server-sent-events framing. Field names are the API's own, so `model_dump()`
is the wire format. A response and a stream's chunks may carry vLLM's top-level `metrics`
(`spec_decode_metrics.WithMetrics`: absent unless the server was asked for it)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, computed_field

from target_service.serving.spec_decode_metrics import WithMetrics
from target_service.serving.tool_protocol import ToolCall

# The reasons a response names. "abort" (the request was cancelled) is vLLM's: the openai package's
# types lack it, and its client, which does not validate by default, passes it through as a string.
# The engine's "error" never reaches a choice: the server answers it with an error (500, or an error
# event in a stream).
FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


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


class CompletionLogprobs(BaseModel):
    """OpenAI's (legacy) completion logprobs, one entry per token: its text, its log-probability
    (null for the prompt's first token, which nothing predicts), the most likely tokens at its
    position as {text: logprob} (the N asked for, and the token itself when it is not among them: up
    to N + 1), and where its text starts (the sum of the texts before it, as vLLM counts)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, other: CompletionLogprobs) -> None:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(other, name))


class CompletionChoice(BaseModel):
    """One choice of a response, or its increment in a stream chunk (finish_reason null until the last)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(WithMetrics):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChunk(WithMetrics):
    """One SSE event of a streamed completion; every chunk of a stream repeats its id and created."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # last chunk (no choices) with include_usage; all with continuous usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is tool calls alone
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    """One token of chat logprobs: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A generated token's logprob and the N most likely tokens at its position, most likely first."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs (OpenAI's `choices[].logprobs`): one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None

    def extend(self, other: ChatLogprobs) -> None:
        self.content = (self.content or []) + (other.content or [])


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(WithMetrics):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunction(BaseModel):
    name: str
    arguments: str


class DeltaToolCall(BaseModel):
    """One whole call, streamed in one piece (name and all the arguments at once)."""

    index: int  # the call's position among the choice's calls
    id: str
    type: Literal["function"] = "function"
    function: DeltaFunction


class DeltaMessage(BaseModel):
    """A choice's increment: the first chunk carries role "assistant", later ones content, or calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionStreamChunk(WithMetrics):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None  # last chunk (no choices) with include_usage; all with continuous usage


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

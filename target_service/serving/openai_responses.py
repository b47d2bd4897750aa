"""The OpenAI-compatible API's response bodies as vLLM serves them: whole responses, stream chunks,
the model list, and the server-sent-events framing. Field names are the API's own, so `model_dump()`
is the wire format."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, computed_field

# The reasons a response names. "abort" (the request was cancelled) is vLLM's: the openai package's
# types lack it, and its client, which does not validate by default, passes it through as a string.
# The engine's "error" never reaches a choice: the server answers it with an error (500, or an error
# event in a stream).
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

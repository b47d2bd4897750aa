"""The OpenAI-compatible API's request bodies as vLLM serves them, engine-free: the sampling fields
both endpoints share (`SamplingRequest`) and /v1/completions' body; chat's is `chat_request.py`'s,
the responses `openai_responses.py`'s.

The HTTP layer parses a body with `CompletionRequest.from_body` / `ChatCompletionRequest.from_body`,
turns it into one `SamplingParams` per choice with `to_sampling_params`, and answers with the
response models of `openai_responses`; every refusal is an `ApiError`, which carries its status, headers and
OpenAI-shaped body. Field names are the API's own (OpenAI's; vLLM's for the extensions top_k,
ignore_eos, stop_token_ids and add_generation_prompt), so `model_dump()` is the wire format.

A field OpenAI defines but this server does not implement (best_of, suffix, the penalties,
logit_bias) is refused by name when set to anything but its no-op value, never dropped: a client that
asked for something must learn it got none. `user` is accepted and ignored.

Logprobs, as vLLM serves them: completions' `logprobs` N (0..MAX_LOGPROBS, 20) returns each
generated token's log-probability and the N most likely tokens; `echo` true puts the prompt's text
(and, with logprobs, its tokens' logprobs, the first null) before the output; `max_tokens` 0 is
allowed with echo alone (the prompt's logprobs only: lm-evaluation-harness's loglikelihood
requests). Chat's `logprobs` true with `top_logprobs` 0..20 (which needs logprobs true when above 0).
The extension `logprobs_mode` ("raw", the default, or "processed") picks the distribution: the
target's own (log_softmax of its logits, vLLM's default) or the one the sampler draws from
(temperature, top-k and top-p applied; one-hot when greedy). A request with prompt logprobs
recomputes the prompt's positions the prefix cache holds, for their logits (`Sequence`).

The extension `num_speculative_tokens` (0..256; null: the server's) caps the drafts that may count
for this request per step (0: none); like every draft count, it changes no greedy token, only speed.

Types are strict and say what the JSON schema says (the served OpenAPI schema is these models'
`model_json_schema()`): a string is no number, a bool no integer, 0 no bool. One rule covers every
integer field: a JSON number is an integer when its value is integral, so 87.0 is the token id 87
(JSON Schema's own definition of "integer"); 87.5, "87" and true are refused.

Limits, checked here before anything is tokenized, expanded or queued (each a 400 naming the field):

| field          | limit                                  | why                                      |
| n              | 1..MAX_N (128)                         | OpenAI's own bound; the server also caps |
|                |                                        | prompts x n at its waiting queue         |
| prompt (batch) | at most MAX_PROMPTS (1024) prompts     | each is tokenized before it is queued    |
| stop           | MAX_STOP_STRINGS (16) strings of       | every step searches the output for each  |
|                | 1..MAX_STOP_CHARS (256) characters     | one, on the engine's thread              |
| stop_token_ids | at most MAX_STOP_TOKEN_IDS (64)        | checked at every token                   |
| logprobs,      | 0..MAX_LOGPROBS (20)                   | vLLM's max_logprobs: a top-k per token   |
| top_logprobs   |                                        | on the device, its values to the host    |
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from target_service.engine.sampling_params import MAX_LOGPROBS, MAX_REQUEST_DRAFTS, SamplingParams
from target_service.serving.api_errors import ApiError
from target_service.serving.structured_fields import StructuredOutputFields, structured_exclusions

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
MAX_PROMPTS = 1024
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_STOP_TOKEN_IDS = 64

# ---- requests -----------------------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """87.0 -> 87: an integral JSON number is an integer (JSON Schema's rule); anything else is left
    for the strict int check to refuse (87.5, "87", true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> Any:
    """The one integer type of every request field: strict, with the integral-number rule, and
    `bounds` (ge, le) in the schema. The bounds go before the validator: after it pydantic would
    write them into the JSON schema as "ge"/"le", which JSON Schema does not know."""
    if not bounds:
        return Annotated[int, BeforeValidator(_integral)]
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def sampling_range(name: str) -> Any:
    """SamplingParams' field `name` with its range (temperature >= 0, 0 < top_p <= 1, ...): the
    request states the same range, so the schema shows it, and the rule stays SamplingParams'."""
    field = SamplingParams.model_fields[name]
    integral = (BeforeValidator(_integral),) if field.annotation is int else ()
    return Annotated[(field.annotation, *field.metadata, *integral)]


TokenId = integer(ge=0, le=INT64_MAX)
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
PromptText = Annotated[str, Field(min_length=1)]  # an empty prompt has no token to start from (vLLM's rule)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = False
    # vLLM's extension (GuideLLM always sends it): with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = False


def _token_ids(value: Any) -> list[int] | None:
    """`value` as token ids (integral numbers made ints), or None when it is no list of them."""
    if not isinstance(value, list):
        return None
    ids = [_integral(t) for t in value]
    if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in ids):
        return ids
    return None


def _request_schema(schema: dict, model: type[SamplingRequest]) -> None:
    """What the validators below add to the types, said in the JSON schema too: a field this server
    does not implement accepts its no-op values or null only (`_refuse_unsupported`), and each rule
    of `_implications` (stream_options needs stream true, ...) is an if/then. One rule stays out, for
    JSON Schema cannot compare two fields: chat's max_tokens and max_completion_tokens, when both are
    set, must agree."""
    for name, accepted in model._no_op.items():
        field = schema["properties"][name]
        field.pop("type", None)
        field["anyOf"] = [{"enum": list(accepted)}, {"type": "null"}] if accepted else [{"type": "null"}]
        field["description"] = "not supported by this server: only its no-op value (or null) is accepted"
    schema["allOf"] = [
        {"if": {"properties": {name: condition}, "required": [name]},
         "then": {"properties": {needed: {"const": True}}, "required": [needed]}}
        for name, condition, needed in model._implications]
    schema["allOf"] += structured_exclusions()


class SamplingRequest(StructuredOutputFields):
    """The fields both endpoints share, and the rule that turns them into `SamplingParams`.

    A null is the field's default. The ranges (max_tokens >= 1, temperature >= 0, 0 < top_p <= 1)
    are SamplingParams' fields' own, restated here so the schema shows them; `to_sampling_params`
    still asks SamplingParams (top_k's -1-or-positive rule and the stop strings are its alone). This
    model also checks the request-only fields (n, seed, stream_options, the refused no-op fields).
    """

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_request_schema)

    # field -> the values that ask for nothing this server lacks (None always does)
    _no_op: ClassVar[dict[str, tuple]] = {"frequency_penalty": (0,), "presence_penalty": (0,),
                                          "repetition_penalty": (1,), "logit_bias": ({},)}
    # (field, a JSON schema of its value, the boolean field that must then be true): the validators'
    # cross-field rules, which the JSON schema states as if/then
    _implications: ClassVar[list[tuple[str, dict, str]]] = [("stream_options", {"type": "object"}, "stream")]
    _prompt_field: ClassVar[str]

    model: str | None = None  # None: the served model
    temperature: sampling_range("temperature") | None = 1.0
    top_p: sampling_range("top_p") | None = 1.0
    top_k: integer(ge=-1) | None = -1  # vLLM: -1 (or 0, or null) is off
    seed: integer(ge=INT64_MIN, le=INT64_MAX) | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # vLLM
    n: integer(ge=1, le=MAX_N) | None = 1
    ignore_eos: bool | None = False  # vLLM
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0  # vLLM; `vllm bench serve` always sends 1.0
    logit_bias: dict[str, float] | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None  # ours: which distribution logprobs are of
    num_speculative_tokens: integer(ge=0, le=MAX_REQUEST_DRAFTS) | None = None  # ours: drafts that may count

    @classmethod
    def from_body(cls, body: Any):
        """The parsed request, or ApiError 400 naming the first bad field, ranges included: every
        refusal but the context length's comes here, before the prompt is rendered or tokenized."""
        try:
            request = cls.model_validate(body)
        except ValidationError as error:
            raise ApiError.from_validation(error) from None
        requested = request._max_tokens_field()[1]
        request._sampling_params(1 if requested is None else requested)  # also the structured spec's shape
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
        """One sentence for every bad stop (the union's own errors would name its members)."""
        texts = [value] if isinstance(value, str) else value
        if value is None or (isinstance(texts, list) and all(isinstance(text, str) for text in texts)):
            if value is not None and len(texts) > MAX_STOP_STRINGS:
                raise ValueError(f"stop has {len(texts)} strings; at most {MAX_STOP_STRINGS} are allowed")
            if value is not None and not all(1 <= len(text) <= MAX_STOP_CHARS for text in texts):
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
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

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far too (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def _max_tokens_field(self) -> tuple[str, int | None]:
        raise NotImplementedError

    def _logprob_fields(self) -> dict:
        """SamplingParams' logprobs and prompt_logprobs, as this endpoint asks for them."""
        raise NotImplementedError

    @property
    def num_logprobs(self) -> int | None:
        """The most likely tokens a choice returns beside each of its tokens (None: no logprobs)."""
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
            "ignore_eos": bool(self.ignore_eos), "logprobs_mode": self.logprobs_mode or "raw",
            "structured_outputs": self.structured_spec(),
            "num_speculative_tokens": self.num_speculative_tokens, **self._logprob_fields(),
        }
        try:
            return SamplingParams(**fields)
        except ValidationError as error:
            name = self._max_tokens_field()[0]
            raise ApiError.from_validation(error, rename={"max_tokens": name}) from None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. Choice index i * n + j is prompt i's choice j (vLLM's order)."""

    _no_op: ClassVar[dict[str, tuple]] = {**SamplingRequest._no_op, "best_of": (1,), "suffix": ("",)}
    _implications: ClassVar[list[tuple[str, dict, str]]] = [*SamplingRequest._implications,
                                                            ("max_tokens", {"const": 0}, "echo")]
    _prompt_field: ClassVar[str] = "prompt"

    prompt: (PromptText | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    echo: bool | None = False  # before max_tokens, whose rule reads it
    max_tokens: integer(ge=0) | None = 16  # 0: with echo, the prompt alone
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    best_of: integer() | None = None
    suffix: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value, info):
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1; 0 is allowed only with echo true (the prompt "
                             "alone, with its logprobs when asked)")
        return value

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (the engine still makes one token, which is dropped)."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def _logprob_fields(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    def _sampling_params(self, max_tokens: int) -> SamplingParams:
        return super()._sampling_params(max(max_tokens, 1))  # echo alone still generates one token

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        """The shapes above, each refused in one sentence naming prompt (a union's own errors would
        name its members); token ids come out as ints."""
        if value in ("", [], [[]]) or (isinstance(value, list) and "" in value):
            raise ValueError("prompt is empty (or holds an empty one): give at least one character or token")
        if isinstance(value, str):
            return value
        ids = _token_ids(value)
        if ids is not None:
            return ids
        if isinstance(value, list) and len(value) > MAX_PROMPTS:
            raise ValueError(f"prompt is a batch of {len(value)} prompts; at most {MAX_PROMPTS} are allowed")
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            return value
        batch = [_token_ids(p) for p in value] if isinstance(value, list) else [None]
        if all(ids for ids in batch):
            return batch
        raise ValueError("prompt must be a string, a list of token ids (integers from 0 to 2**63 - 1), "
                         "or a list of either")

    def prompts(self) -> list[str | list[int]]:
        """The batch: a single string or a single token list is a batch of one."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def _max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

"""`SamplingParams`: how one request samples and when it stops (shaped like vLLM's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from target_service.structured.params import StructuredOutputsParams

GREEDY_EPSILON = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM's API takes it
MAX_LOGPROBS = 20  # most likely tokens returned beside each token (vLLM's default max_logprobs)
MAX_REQUEST_DRAFTS = 256  # a request's num_speculative_tokens: past any drafter's block (K caps it)


class SamplingParams(BaseModel):
    """Validated per-request sampling settings; unknown fields are refused, not dropped.

    temperature 0 is greedy (argmax). top_k -1 and top_p 1.0 switch those filters off. `seed` makes a
    sampled request reproducible whatever else is in the batch.

    The extremes: a temperature below GREEDY_EPSILON (1e-30, subnormals) is greedy, and any finite
    larger one (1e30 included) is computed safely, tending to uniform; a top_p down to the smallest
    float (5e-324) keeps the most likely token; a top_k of V or more is off. Refused, in one line
    naming the field: temperature < 0, inf or NaN; top_p <= 0, > 1 or NaN; top_k 0 or < -1; a seed
    outside int64. There are no min_p or penalties to check.

    Log-probabilities (vLLM's fields): `logprobs` N (0..MAX_LOGPROBS) returns, for every generated
    token, the target's log-probability of it and the N most likely tokens at its position;
    `prompt_logprobs` N the same for each prompt token after the first (a request that asks recomputes
    its prompt's positions even where the prefix cache holds them). `logprobs_mode` "raw" (the default,
    vLLM's `raw_logprobs`) is log_softmax of the target's logits; "processed" is the log of the
    distribution the sampler draws from (temperature, top-k and top-p applied; one-hot when greedy).

    `structured_outputs` (vLLM's): a JSON schema, a regex, a choice or a grammar every output must
    match (`StructuredOutputsParams`); the engine masks the target's choice at every verified
    position, so speculation stays lossless with respect to constrained decoding.

    `num_speculative_tokens` (an extension; no other server has it for DFlash): at most this many of
    a step's drafts may count for this request (0: none, plain decoding at the same speed); None: the
    server's K. Lossless like every draft count, so it changes no greedy token.

    `spec_decode_per_step` (an extension, not an API field: the server sets it under
    `--per-request-spec-decode-metrics detailed`) keeps the request's accepted and verified counts of
    every verify step (`SpecDecodeStats.per_step_accepted`); without it a request keeps O(K) counters.
    It changes no token.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logprobs_mode: Literal["raw", "processed"] = "raw"
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_REQUEST_DRAFTS)
    spec_decode_per_step: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __init__(self, max_tokens: int = 16, **fields):
        super().__init__(max_tokens=max_tokens, **fields)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not SEED_MIN <= value <= SEED_MAX:
            raise ValueError(f"seed must be within int64 ({SEED_MIN}..{SEED_MAX}), got {value}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None:
            return []
        value = [value] if isinstance(value, str) else value
        if any(not isinstance(text, str) or not text for text in value):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value):
        return [] if value is None else value

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

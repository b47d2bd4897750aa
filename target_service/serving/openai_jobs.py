"""One choice of an OpenAI request as the engine runs it, and what it counts and fails with.

A request becomes one `Job` per choice (prompts x n); `OpenAIServer` runs them whole and
`openai_streams` streams them, and both count usage and map engine errors the same way, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from target_service.engine.engine_client import EngineDead, QueueFull
from target_service.engine.outputs import SpecDecodeStats
from target_service.serving.api_errors import ApiError
from target_service.serving.openai_choices import ChoiceAsks, ChoiceView, Piece, TokenTexts

RETRY_AFTER_S = 1
FAILED_ALONE = ("the engine failed on this request (the server log has the details); the server's other "
                "requests were not affected")


@dataclass
class Job:
    """One choice: which engine request, for which prompt, with which params, returning what."""

    index: int
    prompt_token_ids: list[int]
    params: object
    asks: ChoiceAsks = field(default_factory=ChoiceAsks)
    prompt_text: str | None = None  # echoed before the output (None: the ids decoded, once checked)

    def view(self, texts: TokenTexts) -> ChoiceView:
        text = self.prompt_text
        if text is None:
            text = texts.prompt_text(self.prompt_token_ids) if self.asks.echo else ""
        return ChoiceView(self.asks, texts, self.prompt_token_ids, text)


@dataclass
class ChoiceResult:
    """One finished choice."""

    piece: Piece  # its text and logprobs, whole
    finish_reason: str | None
    num_output_tokens: int  # generated tokens it returns (usage)
    spec_decode: SpecDecodeStats | None = None  # the engine's counters of it (its last delta's)


def num_generated(job: Job, last) -> int:
    """The generated tokens a choice returns: none for echo alone (max_tokens 0)."""
    return 0 if job.asks.echo_only else last.num_output_tokens


def prompt_tokens(jobs: list[Job]) -> int:
    """Prompt tokens counted once per prompt (n choices of one prompt share it, as OpenAI counts)."""
    seen, total = set(), 0
    for job in jobs:
        key = id(job.prompt_token_ids)
        if key not in seen:
            seen.add(key)
            total += len(job.prompt_token_ids)
    return total


def as_api_error(error: Exception) -> ApiError:
    """What an engine refusal is told as: a full queue 429, a dead engine 503, the rest 400."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, QueueFull):
        return ApiError.overloaded(error.retry_after_s, str(error))
    if isinstance(error, EngineDead):
        return ApiError.unavailable(RETRY_AFTER_S, str(error))
    return ApiError.bad_request(str(error), "prompt")

"""OpenAIServer: the OpenAI-compatible API's domain object, between the protocol and the engine.

It turns a validated request into engine requests (prompts tokenized, chats rendered with the
checkpoint's template, one `SamplingParams` per choice), runs them on an `EngineClient`, and turns
their deltas into responses; `openai_streams` turns them into stream chunks. It knows nothing of
HTTP: the routes (`api.py`) parse, authenticate and call it; errors are `ApiError`s the routes send
as they are.

Tokenizing runs on a worker thread (a long prompt takes about a second a MiB), so the event loop
keeps streaming the other requests meanwhile.

A request the engine failed alone (finish reason "error") is a 500 for it alone, or in a stream an
error event and `[DONE]`; the other requests run on. A drain (`drain`, or its parts for a caller
that paces it) refuses new requests with 503, waits for those in flight, and when its time is up
stops them with an answer: 503, or an error event and `[DONE]` (`InFlight`).

What a choice returns besides its text (the echoed prompt, logprobs) is shaped by `openai_choices`, one
piece per engine delta; a whole response joins the pieces its stream would send. With
`spec_decode_metrics` (the server's --per-request-spec-decode-metrics) a one-choice response also
carries its speculative-decoding stats (`spec_decode_metrics`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

from foundation.checkpoint_config import load_target_config
from target_service.engine.engine_client import EngineClient, EngineDead, QueueFull
from target_service.serving.api_errors import ApiError
from target_service.serving.chat_request import ChatCompletionRequest
from target_service.serving.chat_template import load_chat_template
from target_service.serving.in_flight import InFlight
from target_service.serving.openai_choices import ChoiceAsks, TokenTexts, merge
from target_service.serving.openai_jobs import (
    FAILED_ALONE,
    RETRY_AFTER_S,
    ChoiceResult,
    Job,
    as_api_error,
    num_generated,
    prompt_tokens,
)
from target_service.serving.openai_protocol import CompletionRequest
from target_service.serving.openai_responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from target_service.serving.openai_streams import ChoiceStreams
from target_service.serving.openapi_schema import ServedLimits
from target_service.serving.prompt_chars import max_prompt_chars
from target_service.serving.spec_decode_metrics import SpecDecodeMetricsLevel, response_metrics
from target_service.serving.tool_formats import assistant_message, model_type_of, tool_format
from target_service.structured.params import StructuredOutputsParams

DRAIN_POLL_S = 0.05
STOP_GRACE_S = 2.0  # how long stopped requests get to send their answers


class OpenAIServer:
    def __init__(
        self,
        async_engine: EngineClient,
        tokenizer,
        *,
        model_name: str,
        max_model_len: int,
        target_dir: str | Path,
        api_key: str | None = None,
        spec_decode_metrics: SpecDecodeMetricsLevel | None = None,
    ):
        """spec_decode_metrics: "summary" or "detailed" adds each one-choice response's stats
        (vLLM's --per-request-spec-decode-metrics); None (the default) leaves responses as they were."""
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.target_dir = Path(target_dir)
        self.tool_format = tool_format(model_type_of(self.target_dir))
        # what the served schema bounds: prompt token ids lie in the vocabulary, outputs in the context
        self.limits = ServedLimits(load_target_config(self.target_dir).vocab_size, max_model_len)
        self.api_key = api_key
        self.spec_decode_metrics = spec_decode_metrics
        self.draining = False
        self.in_flight = InFlight()
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)
        self.token_texts = TokenTexts(tokenizer)
        self.streams = ChoiceStreams(async_engine, self.in_flight, self.token_texts, model_name,
                                     spec_decode_metrics=spec_decode_metrics)

    # ---- reading ----------------------------------------------------------------------------------

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy and not self.draining

    # ---- draining ---------------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def begin_drain(self) -> int:
        """Refuse new requests (503) from now on; returns how many are in flight."""
        self.draining = True
        return len(self.in_flight)

    def stop_in_flight(self, reason: str) -> int:
        """End every request still in flight with `reason` (503, or an error event and [DONE])."""
        return self.in_flight.stop_all(reason)

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to `timeout_s` for those in flight, then stop the rest and
        give them a moment to answer, and the engine a moment to free their pages; returns how many
        were stopped. Blocks: call it from another thread than the event loop's."""
        self.begin_drain()
        _wait_until_empty(self.in_flight, timeout_s)
        if not len(self.in_flight):
            return 0
        stopped = self.stop_in_flight(drain_expired(timeout_s))
        _wait_until_empty(self.in_flight, STOP_GRACE_S)
        _wait_until_idle(self.engine, STOP_GRACE_S)
        return stopped

    # ---- requests ---------------------------------------------------------------------------------

    async def completion_jobs(self, request: CompletionRequest) -> list[Job]:
        self._check_model(request.model)
        prompts = request.prompts()
        self._check_choices(len(prompts), request.n or 1)
        asks = ChoiceAsks(request.num_logprobs, bool(request.echo), request.echo_only)
        jobs, num_choices = [], len(prompts) * (request.n or 1)
        for number, prompt in enumerate(prompts):
            ids = await self._encode(prompt, "prompt")
            text = prompt if isinstance(prompt, str) else None
            for j, params in enumerate(self._sampling_params(request, len(ids), num_choices)):
                jobs.append(Job(number * (request.n or 1) + j, ids, params, asks, text))
        return jobs

    async def chat_jobs(self, request: ChatCompletionRequest) -> list[Job]:
        self._check_model(request.model)
        self._check_choices(1, request.n or 1)
        try:
            messages = [message.for_template() for message in request.messages]
            text = load_chat_template(self.target_dir).render(messages, request.add_generation_prompt,
                                                              tools=request.tools_for_template())
        except ValueError as error:
            raise ApiError.bad_request(str(error), "messages") from None
        ids = await self._encode(text, "messages", add_special_tokens=False)
        tools = self.tool_format if request.uses_tools else None
        asks = ChoiceAsks(request.num_logprobs, chat=True, tools=tools)
        params = self._sampling_params(request, len(ids), request.n or 1)
        forced = request.forced_functions
        if forced is not None:  # required, or a named function: the calls are forced by a grammar
            grammar = self.tool_format.grammar(forced, parallel=request.parallel_tool_calls is not False)
            try:
                spec = StructuredOutputsParams(grammar=grammar)
            except ValueError as error:
                raise ApiError.bad_request(f"tools: {error}", "tools") from None
            params = [choice.model_copy(update={"structured_outputs": spec}) for choice in params]
        return [Job(j, ids, choice, asks) for j, choice in enumerate(params)]

    async def completion(self, request: CompletionRequest) -> CompletionResponse:
        jobs = await self._preflight(await self.completion_jobs(request), request.structured_field)
        results = await self._run_all(jobs)
        choices = [
            CompletionChoice(index=job.index, text=result.piece.text, logprobs=result.piece.logprobs,
                             finish_reason=result.finish_reason)
            for job, result in zip(jobs, results)
        ]
        return CompletionResponse(
            model=self.model_name,
            choices=sorted(choices, key=lambda c: c.index),
            usage=self._usage(jobs, results),
            metrics=self._metrics(results),
        )

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        jobs = await self._preflight(await self.chat_jobs(request), request.grammar_field)
        results = await self._run_all(jobs)
        choices = []
        for job, result in zip(jobs, results):
            message, reason = assistant_message(job.asks.tools, result.piece.text, result.finish_reason)
            choices.append(ChatCompletionChoice(index=job.index, message=message,
                                                logprobs=result.piece.logprobs, finish_reason=reason))
        return ChatCompletionResponse(
            model=self.model_name, choices=choices, usage=self._usage(jobs, results),
            metrics=self._metrics(results),
        )

    async def completion_stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        """SSE events of a streamed completion. Everything that can refuse the request runs here,
        before the first event, so a refusal is an HTTP error status, not an event mid-stream."""
        jobs = await self._preflight(await self.completion_jobs(request), request.structured_field)
        return self.streams.completion(jobs, request.include_usage, request.continuous_usage)

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        jobs = await self._preflight(await self.chat_jobs(request), request.grammar_field)
        return self.streams.chat(jobs, request.include_usage, request.continuous_usage)

    # ---- running ----------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError.model_not_found(name, self.model_name)

    def _check_choices(self, num_prompts: int, n: int) -> None:
        """Before any prompt is tokenized or any choice made: a request whose choices (prompts x n, one
        engine request each) outnumber the waiting queue could never be admitted, so it is a 400, not
        a 429 that a client would retry forever."""
        capacity = self.engine.max_waiting
        if num_prompts * n > capacity:
            asked = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
            raise ApiError.bad_request(
                f"{'n' if n > 1 else 'prompt'}: this request asks for {num_prompts * n} choices ({asked}); "
                f"this server queues at most {capacity} at a time (--max-waiting): split the request",
                "n" if n > 1 else "prompt")

    def _sampling_params(self, request, num_prompt_tokens: int, num_choices: int) -> list:
        """The request's params, one per choice; under "detailed" the engine keeps each step's counts
        for a request of one choice (the only kind whose response carries them)."""
        params = request.to_sampling_params(num_prompt_tokens, self.max_model_len)
        if self.spec_decode_metrics == "detailed" and num_choices == 1:
            params = [choice.model_copy(update={"spec_decode_per_step": True}) for choice in params]
        return params

    async def _encode(self, prompt, field: str, *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if self.tokenizer is None:
            raise ApiError.bad_request(f"{field}: this model has no tokenizer; send token ids", field)
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            # tokenizing holds the event loop (~1.3 s a MiB): a text that cannot fit is refused unread
            raise ApiError.bad_request(
                f"{field}: the prompt has {len(prompt)} characters, more than {self.max_model_len} tokens "
                f"(this model's maximum context length) can hold", field)
        # encode_batch lets go of the GIL while it works (encode does not), so the loop runs meanwhile
        encoded = await asyncio.to_thread(self.tokenizer.encode_batch, [prompt],
                                          add_special_tokens=add_special_tokens)
        return encoded[0].ids

    async def _preflight(self, jobs: list[Job], structured_field: str | None) -> list[Job]:
        """Refuse now what would fail later: shutting down, a full queue, a prompt the pool cannot hold,
        a structured-output spec (from `structured_field`) that does not compile."""
        if self.draining:
            raise ApiError.unavailable(RETRY_AFTER_S, "the server is shutting down")
        if self.engine.num_waiting + len(jobs) > self.engine.max_waiting:
            raise ApiError.overloaded(
                RETRY_AFTER_S, f"{self.engine.num_waiting} requests are already waiting; retry later"
            )
        checked = set()  # a prompt's n choices share its ids and differ only in their seeds
        for job in jobs:
            if id(job.prompt_token_ids) in checked:
                continue
            checked.add(id(job.prompt_token_ids))
            try:
                if job.params.structured_outputs is None and not self.engine.check_blocks:
                    self.engine.check(job.prompt_token_ids, job.params)
                else:  # compiling a grammar, or asking the target's actor, waits: off the event loop
                    await asyncio.to_thread(self.engine.check, job.prompt_token_ids, job.params)
            except ValueError as error:
                field = structured_field if str(error).startswith("structured outputs") else "prompt"
                raise ApiError.bad_request(str(error), field) from None
        return jobs

    async def _run_one(self, job: Job) -> ChoiceResult:
        """One choice, whole (the pieces its stream would send, joined). Its latency is timed by the
        engine client's wrapper (`metered_engine`), where every delta passes."""
        pieces, last, view = [], None, job.view(self.token_texts)
        try:
            async for delta in self.engine.generate(job.prompt_token_ids, job.params):
                pieces.append(view.piece(delta))
                last = delta
        except (QueueFull, EngineDead, ValueError) as error:
            raise as_api_error(error) from None
        except asyncio.CancelledError:  # the client left, or the server stopped it: an aborted request
            if self.in_flight.stopped:
                raise ApiError.unavailable(RETRY_AFTER_S, self.in_flight.stop_reason) from None
            raise
        if last.finish_reason == "error":
            raise ApiError.internal(FAILED_ALONE)
        return ChoiceResult(merge(pieces), last.finish_reason, num_generated(job, last), last.spec_decode)

    async def _run_all(self, jobs: list[Job]) -> list[ChoiceResult]:
        """Every choice concurrently; if one fails (or the client leaves), the others are cancelled."""
        tasks = [self.in_flight.start(self._run_one(job)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def _metrics(self, results: list[ChoiceResult]):
        return response_metrics(self.spec_decode_metrics, [result.spec_decode for result in results])

    def _usage(self, jobs: list[Job], results: list[ChoiceResult]) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens(jobs),
                         completion_tokens=sum(result.num_output_tokens for result in results))


def drain_expired(timeout_s: float) -> str:
    """What a request still running when a drain's time is up is told."""
    return (f"the server is shutting down and its drain time ({timeout_s:g} s) ran out before this "
            "request finished; retry it")


def _wait_until_idle(engine: EngineClient, timeout_s: float) -> None:
    """Wait for the engine to have let go of the stopped requests (their aborts reach it between
    steps), so a drain that returns has every page back in the pool."""
    deadline = time.monotonic() + timeout_s
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(DRAIN_POLL_S)


def _wait_until_empty(in_flight: InFlight, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(in_flight) and time.monotonic() < deadline:
        time.sleep(DRAIN_POLL_S)

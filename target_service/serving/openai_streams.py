"""A streamed completion or chat as SSE events: every choice's deltas interleaved as they come.

`OpenAIServer` checks and admits a request, then hands its jobs here. Each choice is pumped from the
engine on a task of its own, so one slow or failing choice holds up none of the others; usage comes
last when asked (and, with vLLM's `continuous_usage_stats`, on every chunk); the stream always ends
in `[DONE]`, after an error event where a choice failed or the server stopped it. A client that
leaves closes the generator, which cancels what still runs and so aborts it in the engine.
With `spec_decode_metrics` the usage chunk also carries a one-choice request's speculative-decoding
stats (`spec_decode_metrics`), once; the token chunks never do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from target_service.engine.engine_client import EngineClient, EngineDead, QueueFull
from target_service.serving.api_errors import ApiError
from target_service.serving.in_flight import InFlight
from target_service.serving.openai_choices import Piece, TokenTexts
from target_service.serving.openai_jobs import (
    FAILED_ALONE,
    RETRY_AFTER_S,
    Job,
    as_api_error,
    num_generated,
    prompt_tokens,
)
from target_service.serving.openai_responses import (
    SSE_DONE,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    CompletionChoice,
    CompletionStreamChunk,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
    random_id,
    sse_event,
)
from target_service.serving.spec_decode_metrics import SpecDecodeMetricsLevel, response_metrics
from target_service.serving.tool_formats import ToolCallSplitter

logger = logging.getLogger(__name__)


class ChoiceStreams:
    """Streams the jobs of admitted requests from one engine, counted in one `InFlight`."""

    def __init__(self, engine: EngineClient, in_flight: InFlight, token_texts: TokenTexts, model_name: str,
                 *, spec_decode_metrics: SpecDecodeMetricsLevel | None = None):
        self.engine = engine
        self.spec_decode_metrics = spec_decode_metrics
        self.in_flight = in_flight
        self.token_texts = token_texts
        self.model_name = model_name

    async def completion(self, jobs: list[Job], include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        stream_id, created = random_id("cmpl"), int(time.time())

        def chunk(index, piece: Piece, reason):
            return CompletionStreamChunk(
                id=stream_id,
                created=created,
                model=self.model_name,
                choices=[CompletionChoice(index=index, text=piece.text, logprobs=piece.logprobs,
                                          finish_reason=reason)],
            )

        async for event in self._events(jobs, chunk, include_usage, stream_id, created, chat=False,
                                        continuous=continuous):
            yield event

    async def chat(self, jobs: list[Job], include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        stream_id, created = random_id("chatcmpl"), int(time.time())
        for job in jobs:  # the role comes first, once per choice
            yield sse_event(
                ChatCompletionStreamChunk(
                    id=stream_id,
                    created=created,
                    model=self.model_name,
                    choices=[
                        ChatCompletionStreamChoice(index=job.index, delta=DeltaMessage(role="assistant"))
                    ],
                )
            )

        splitters = {job.index: ToolCallSplitter(job.asks.tools) for job in jobs if job.asks.tools}

        def chunk(index, piece: Piece, reason):
            splitter = splitters.get(index)
            if splitter is None:
                delta = DeltaMessage(content=piece.text) if piece.text else DeltaMessage()
            else:
                delta, reason = tool_delta(splitter, piece.text, reason)
            return ChatCompletionStreamChunk(
                id=stream_id,
                created=created,
                model=self.model_name,
                choices=[ChatCompletionStreamChoice(index=index, delta=delta, logprobs=piece.logprobs,
                                                    finish_reason=reason)],
            )

        async for event in self._events(jobs, chunk, include_usage, stream_id, created, chat=True,
                                        continuous=continuous):
            yield event

    async def _events(self, jobs, chunk, include_usage: bool, stream_id: str, created: int, *, chat: bool,
                      continuous: bool = False):
        """Every choice's deltas as SSE events, interleaved as they come; usage last when asked, and
        with `continuous` the usage so far on every chunk too (the choices' tokens up to it)."""
        events: asyncio.Queue = asyncio.Queue()
        totals, so_far, stats = {}, {}, {}

        def emit(job: Job, delta, event) -> None:
            if continuous:
                so_far[job.index] = num_generated(job, delta)
                event.usage = UsageInfo(prompt_tokens=prompt_tokens(jobs),
                                        completion_tokens=sum(so_far.values()))
            events.put_nowait(sse_event(event))

        def fail(error: ApiError) -> None:
            events.put_nowait(sse_event(error.to_response()))

        async def pump(job: Job):
            last, view = None, job.view(self.token_texts)
            try:
                async for delta in self.engine.generate(job.prompt_token_ids, job.params):
                    last = delta
                    piece = view.piece(delta)  # a chunk carries the logprobs of the tokens it carries
                    if delta.finish_reason == "error":  # what it streamed stands; it ends in an error
                        if piece.text or piece.num_tokens:
                            emit(job, delta, chunk(job.index, piece, None))
                        fail(ApiError.internal(FAILED_ALONE))
                    elif piece.text or delta.finished or (piece.num_tokens and piece.logprobs is not None):
                        emit(job, delta, chunk(job.index, piece, delta.finish_reason))
                totals[job.index] = num_generated(job, last)
                stats[job.index] = last.spec_decode
            except (QueueFull, EngineDead, ValueError) as error:
                fail(as_api_error(error))
            except asyncio.CancelledError:  # the client left mid-stream, or the server stopped it
                if not self.in_flight.stopped:
                    raise
                fail(ApiError.unavailable(RETRY_AFTER_S, self.in_flight.stop_reason))
            except Exception as error:  # a bug: this stream says so and ends; the others go on
                logger.exception("a stream's request failed")
                fail(ApiError.internal(f"the server failed on this request ({type(error).__name__}); "
                                       "the server log has the details"))
            finally:
                events.put_nowait(None)

        tasks = [self.in_flight.start(pump(job)) for job in jobs]
        try:
            done = 0
            while done < len(tasks):
                event = await events.get()
                if event is None:
                    done += 1
                else:
                    yield event
            if include_usage:
                usage = UsageInfo(prompt_tokens=prompt_tokens(jobs), completion_tokens=sum(totals.values()))
                metrics = response_metrics(self.spec_decode_metrics, [stats.get(job.index) for job in jobs])
                kind = ChatCompletionStreamChunk if chat else CompletionStreamChunk
                yield sse_event(kind(id=stream_id, created=created, model=self.model_name, choices=[],
                                     usage=usage, metrics=metrics))
            yield SSE_DONE
        finally:  # the client left (or the stream ended): stop what still runs, which aborts it
            for task in tasks:
                task.cancel()


def tool_delta(splitter: ToolCallSplitter, text: str, reason: str | None) -> tuple[DeltaMessage, str | None]:
    """A chat-with-tools chunk: the content the splitter lets go, the calls it completed (each whole,
    numbered in the choice's order), and "tool_calls" for a choice that stopped with calls."""
    content, calls = splitter.feed(text, final=reason is not None)
    first = splitter.num_calls - len(calls)
    deltas = [DeltaToolCall(index=first + i, id=call.id, function=DeltaFunction(name=call.name,
                                                                                arguments=call.arguments))
              for i, call in enumerate(calls)]
    if reason == "stop" and splitter.num_calls:
        reason = "tool_calls"
    return DeltaMessage(content=content or None, tool_calls=deltas or None), reason

"""MeteredEngine: an `EngineClient` that times every request it passes on, for the replica's metrics.

The OpenAI server drives it as it would the engine. Each request gets a `RequestTimes`: its arrival
here, the first step that schedules it (the engine's `on_scheduled` hook, wired to `scheduled` by
whoever assembled the replica), and its first and last tokens as their deltas pass. From those
`ServerMetrics` counts the prompt and generation tokens as they come, the gap before each token, and
when the request ends its latency, phases and sizes, with its finish reason ("abort" when the
consumer went away: the client left, or the server stopped it). A request the engine refused before
its first delta (a full queue, a dead engine, a prompt that could never run) never ran: it is not
counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

from target_service.engine.engine_client import EngineClient, RequestDelta
from target_service.engine.sampling_params import SamplingParams
from target_service.serving.metrics import RequestTimes, ServerMetrics


class MeteredEngine:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self._times: dict[str, RequestTimes] = {}  # the requests in flight, by request id
        self._ids = itertools.count()

    # ---- the engine's surface, unchanged ------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    @property
    def check_blocks(self) -> bool:
        return self.engine.check_blocks

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def max_waiting(self) -> int:
        return self.engine.max_waiting

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check(prompt_token_ids, params)

    def snapshot(self):
        return self.engine.snapshot()

    def shutdown(self, timeout: float = 30.0) -> None:
        self.engine.shutdown(timeout)

    # ---- timing -------------------------------------------------------------------------------------

    def scheduled(self, request_id: str, at: float) -> None:
        """The engine scheduled a prefill chunk of `request_id` at `at` (time.monotonic()); the first
        time counts. Called from the engine's thread (or the loop, for the engine in the target actor)."""
        times = self._times.get(request_id)
        if times is not None and times.scheduled is None:
            times.scheduled = at

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """The engine's deltas of one request, timed on the way through."""
        request_id = request_id or f"metered-{next(self._ids)}"
        times = RequestTimes(time.monotonic(), len(prompt_token_ids), params.max_tokens)
        self._times[request_id] = times
        reason, ran = None, False
        try:
            deltas = self.engine.generate(prompt_token_ids, params, request_id)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    ran = True
                    self._arrived(times, delta, time.monotonic())
                    if delta.finished:
                        reason = delta.finish_reason
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the consumer went away: the engine aborts it
            ran = True
            raise
        except Exception:  # refused before its first delta (it never ran), or the engine failed under it
            reason = "error"
            raise
        finally:
            del self._times[request_id]
            if ran:
                self.metrics.finished(times, reason or "abort", time.monotonic())

    def _arrived(self, times: RequestTimes, delta: RequestDelta, now: float) -> None:
        count = len(delta.token_ids)
        if not count:
            return
        if times.first_token is None:
            times.first_token = times.last_token = now
            self.metrics.first_token(times)
            self.metrics.tokens(count, None)
        else:
            self.metrics.tokens(count, now - times.last_token)
            times.last_token = now
        times.num_generation_tokens += count

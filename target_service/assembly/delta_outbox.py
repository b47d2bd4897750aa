"""DeltaOutbox: every request's deltas leave the target service together, one batch per wake-up.

Carrying each request's deltas as items of its own Ray streaming call cost ~0.4 ms of CPU per delta
in the target's process and ~0.7 ms in the replica's (2 CPU cores; `bench/results/delta_transport_cpu.md`):
at concurrency 32 that is 32 items a step, work that competes with the step loop for the GIL and
with the replica's event loop for its one thread. So the target keeps one outbox: each request runs
as a task (`start`) that reads its deltas from the engine and posts them here, and one long-lived
stream (`batches`) hands the replica everything posted since its last batch. The replica routes
them by request id (`DeltaRouter`).

What a batch holds, in the order posted: a `RequestDelta`; a `RequestScheduled` (once, before a
request's first delta: when the engine first scheduled it); a `RequestFailed` (the request's own
error before or instead of a delta: refused, queue full, engine dead). A request ends with its
finished delta or its failure.

A request is aborted by `abort` (its client went away): its task is cancelled, which closes its
engine stream and so frees its pages. When the reader of `batches` goes away (the replica stopped or
died), nobody can read what is posted: every request in the outbox is aborted. A newer reader takes
over from an older one, and only the current reader's end aborts.

This class knows nothing of Ray; the target service's actor methods delegate to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from target_service.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestScheduled:
    """Sent once, before a request's first delta: when the engine first scheduled it, on the target
    process's `time.monotonic()` (the replica reading it runs on the same node: the trio sits in the
    replica's placement group)."""

    request_id: str
    at: float


@dataclass(frozen=True)
class RequestFailed:
    """A request's own error (ValueError: refused; QueueFull; EngineDead), instead of more deltas."""

    request_id: str
    error: BaseException


class DeltaOutbox:
    def __init__(self, generate: Callable[..., AsyncIterator]):
        """generate(prompt_token_ids, params, request_id): the engine's stream of one request's
        deltas (`AsyncEngine.generate`); closing it early aborts the request."""
        self._generate = generate
        self._tasks: dict[str, asyncio.Task] = {}
        self._scheduled_at: dict[str, float | None] = {}  # requests not yet known to be scheduled
        self._posted: list = []
        self._wake: asyncio.Event | None = None  # made on the event loop, at first use
        self._reader = 0  # which call of `batches` is the current reader

    @property
    def num_requests(self) -> int:
        return len(self._tasks)

    def start(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        """Run one request; what it yields, or its error, is posted. A request id already running is
        refused (a `RequestFailed` for it: the replica names every request uniquely)."""
        if request_id in self._tasks:
            self._post(RequestFailed(request_id, ValueError(f"request id {request_id!r} is already running")))
            return
        self._scheduled_at[request_id] = None
        self._tasks[request_id] = asyncio.get_running_loop().create_task(
            self._run(prompt_token_ids, params, request_id), name=f"dflash-request-{request_id}")

    def fail(self, request_id: str, error: BaseException) -> None:
        """Post a failure for a request that could not start (the engine is not up)."""
        self._post(RequestFailed(request_id, error))

    def abort(self, request_id: str) -> bool:
        """Stop one request (its client went away); False when it is not running here."""
        task = self._tasks.pop(request_id, None)
        if task is None:
            return False
        task.cancel()
        return True

    def note_scheduled(self, request_id: str, at: float) -> None:
        """The engine's on_scheduled, from its thread: the first time a request is scheduled."""
        if request_id in self._scheduled_at and self._scheduled_at[request_id] is None:
            self._scheduled_at[request_id] = at

    async def batches(self) -> AsyncIterator[list]:
        """Everything posted since the last batch, as soon as there is any; forever. Ending it (the
        reader went away) aborts every request here, unless a newer reader has taken over."""
        self._reader += 1
        reader = self._reader
        wake = self._wake_event()
        try:
            while True:
                while not self._posted:
                    wake.clear()
                    await wake.wait()
                    if reader != self._reader:
                        return
                await asyncio.sleep(0)  # the other requests woken by the same step post theirs
                batch, self._posted = self._posted, []
                yield batch
        finally:
            if reader == self._reader:
                self._abort_all()

    # ---- the requests' tasks ----------------------------------------------------------------------

    async def _run(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        try:
            async with contextlib.aclosing(self._generate(prompt_token_ids, params, request_id)) as deltas:
                async for delta in deltas:
                    at = self._scheduled_at.get(request_id)
                    if at is not None:  # set by the engine's thread before the step that made this delta
                        self._post(RequestScheduled(request_id, self._scheduled_at.pop(request_id)))
                    self._post(delta)
        except asyncio.CancelledError:  # aborted: its client is gone, nothing is posted
            raise
        except Exception as error:  # the request's own failure, for its client
            self._post(RequestFailed(request_id, error))
        finally:
            self._scheduled_at.pop(request_id, None)
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]

    def _post(self, item) -> None:
        self._posted.append(item)
        self._wake_event().set()

    def _wake_event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def _abort_all(self) -> None:
        if self._tasks:
            logger.warning("the replica stopped reading deltas: aborting its %d requests", len(self._tasks))
        for request_id in list(self._tasks):
            self.abort(request_id)
        self._posted = []

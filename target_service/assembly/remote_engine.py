"""RemoteEngine: what the HTTP server drives when the engine runs in the target service's actor.

It offers the `AsyncEngine` surface the OpenAI server, the metrics and the drain read (`generate`,
`check`, `snapshot`, `num_running`, `num_waiting`, `is_healthy`, `shutdown`), over a `RayServices`
trio: a request is started on the target actor (`start_request`, not waited for) and its deltas
arrive, with every other request's, in the batches of one Ray streaming call that a `DeltaRouter`
hands out by request id; closing a request's iterator early (a client that went away) sends `abort`,
which frees its pages in the target. The HTTP contract does not change.

The target sends, before a request's first delta, when its engine first scheduled it
(`RequestScheduled`): that goes to `on_scheduled`, as the in-process engine's hook would. A request's
own error (`RequestFailed`: refused, queue full) is raised before any delta, as the in-process engine
raises it.

Admission (429) counts the requests this replica has in flight, locally: those past max_num_seqs are
the waiting ones, as the target's engine would hold them (it may hold more waiting while pages are
short; the target's own queue bound still applies behind this one).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator

from target_service.assembly.delta_outbox import RequestFailed, RequestScheduled
from target_service.assembly.delta_router import DeltaRouter
from target_service.engine.engine_client import EngineDead, EngineSnapshot, QueueFull, RequestDelta
from target_service.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RemoteEngine:
    check_blocks = True  # `check` asks the target and waits: the server calls it off its event loop

    def __init__(self, services, *, max_num_seqs: int, max_waiting: int = 256):
        """services: a started `RayServices` (this object closes it on shutdown)."""
        self.services = services
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self._in_flight = 0
        self._stopping = False
        self._failed: BaseException | None = None
        self.on_scheduled = None  # on_scheduled(request_id, time.monotonic()), as LLMEngine's hook
        self.router = DeltaRouter(services.delta_batches, _target_died)
        self._ids = itertools.count()

    # ---- what the server reads --------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._failed is None and not self._stopping

    @property
    def num_running(self) -> int:
        return min(self._in_flight, self.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return max(0, self._in_flight - self.max_num_seqs)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The target's own refusal (ValueError) of a request that could never run; EngineDead when
        the target cannot answer (it died and is not back within its start-up time)."""
        from target_service.assembly.ray_services import ServiceFailed

        try:
            self.services.check(prompt_token_ids, params)
        except ServiceFailed as error:
            raise EngineDead(str(error)) from None

    def snapshot(self) -> EngineSnapshot:
        state = self.services.snapshot()
        return EngineSnapshot(state["stats"], state["num_running"], state["num_waiting"],
                              self.services.pool_stats(), state["num_steps"], state["num_steps_ahead"],
                              self.services.compilations())

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas from the target actor; closing the iterator early aborts it."""
        if self._stopping:
            raise EngineDead("the engine is shutting down; it takes no new requests")
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(self.num_waiting)
        request_id = request_id or f"remote-{next(self._ids)}"
        items = self.router.open(request_id)  # before the start: no item of it can arrive unrouted
        self._in_flight += 1
        finished = False
        try:
            self.services.start_request(prompt_token_ids, params, request_id)
            while True:
                item = await items.get()
                if isinstance(item, RequestScheduled):
                    if self.on_scheduled is not None:
                        self.on_scheduled(item.request_id, item.at)
                    continue
                if isinstance(item, RequestFailed):
                    raise item.error
                if isinstance(item, BaseException):  # the stream broke: the target died
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._in_flight -= 1
            self.router.close(request_id)
            if not finished:
                self.services.abort(request_id)  # the target's engine aborts it and frees its pages

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let those in flight finish, then stop the three services."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.services.close()


def _target_died(error: BaseException) -> str:
    return f"the target service died mid-request: {error}"

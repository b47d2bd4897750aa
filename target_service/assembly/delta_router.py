"""DeltaRouter: the replica's end of the target's one stream of delta batches (`DeltaOutbox`).

A request registers its queue (`open`) before it is started on the target, so none of its items can
arrive unrouted; one reader task takes the batches and puts each item on its request's queue. Items
of a request no longer registered (its client went away and it was aborted) are dropped.

The reader runs while requests are open: `open` starts it when none runs. When the stream breaks (the
target's actor died), every open request gets `EngineDead` on its queue and the reader ends; the next
`open` starts a new stream, which Ray holds until the target is back.

This class knows nothing of Ray: `open_stream` gives the batches (the Ray streaming call, unwrapped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from target_service.engine.engine_client import EngineDead

logger = logging.getLogger(__name__)


class DeltaRouter:
    def __init__(self, open_stream: Callable[[], AsyncIterator[list]],
                 describe_failure: Callable[[BaseException], str] = repr):
        """open_stream(): a new stream of the target's batches. describe_failure(error): the message
        every open request's `EngineDead` carries when the stream broke with `error`."""
        self._open_stream = open_stream
        self._describe_failure = describe_failure
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.num_batches = 0
        self.num_items = 0

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue `request_id`'s items will arrive on; call before starting it on the target."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already open on this replica")
        queue = self._queues[request_id] = asyncio.Queue()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="dflash-delta-router")
        return queue

    def close(self, request_id: str) -> None:
        """The request is done with (finished, failed, or its client left): later items are dropped."""
        self._queues.pop(request_id, None)

    async def stop(self) -> None:
        """End the reader (the target is being shut down)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None

    async def _read(self) -> None:
        try:
            async for batch in self._open_stream():
                self.num_batches += 1
                self.num_items += len(batch)
                for item in batch:
                    queue = self._queues.get(item.request_id)
                    if queue is not None:
                        queue.put_nowait(item)
            failure = EngineDead("the target service stopped sending deltas")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the stream broke: the target's actor is gone
            log = logger.warning if self._queues else logger.info
            log("the target's delta stream broke with %d requests open: %r", len(self._queues), error)
            failure = EngineDead(self._describe_failure(error))
        for queue in self._queues.values():
            queue.put_nowait(failure)
        self._queues.clear()

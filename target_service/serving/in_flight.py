"""InFlight: the server's running request tasks, so that a shutdown can end them with an answer.

A drain waits for these tasks to finish; when its time is up they are stopped: each is cancelled
(which aborts its engine request and frees its pages) with the reason recorded here first, so the
task knows it was stopped by the server, not left by its client, and answers accordingly: a whole
response becomes a 503, a stream gets an error event and `[DONE]`. The drain runs on another
thread than the event loop that owns the tasks, so stopping goes through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio


class InFlight:
    def __init__(self):
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stop_reason: str | None = None  # set once the server stops what still runs

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work) -> asyncio.Task:
        """`work` (a coroutine) as a task this registry holds until it is done."""
        task = asyncio.ensure_future(work)
        self._loop = asyncio.get_running_loop()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def stopped(self) -> bool:
        """Whether the server stopped what runs: a cancellation a task meets now is the server's
        doing, not its client's."""
        return self.stop_reason is not None

    def stop_all(self, reason: str) -> int:
        """From any thread: cancel every task, each told `reason`; returns how many there were."""
        self.stop_reason = reason
        tasks, loop = list(self._tasks), self._loop
        if tasks and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: [task.cancel() for task in tasks])
        return len(tasks)

"""AsyncEngine: the engine's step loop in one thread, requests submitted and streamed from asyncio.

`LLMEngine` is synchronous and single-threaded by design; a server's event loop must never wait on a
step. So one thread owns the engine: between steps it takes new requests and cancellations from a
queue, runs steps while there is work, and hands each request its new tokens and text through that
request's asyncio queue (`loop.call_soon_threadsafe`). Nothing else touches the engine.

Admission control: at most `max_waiting` requests wait for a slot; past that `generate` raises
`QueueFull` at once (the HTTP layer answers 429 with Retry-After), and nothing is enqueued. A request
whose consumer goes away (client disconnect: the async generator is closed or cancelled) is aborted,
which frees its pages before the next step; so is one whose event loop has closed under it (a
delta that can no longer be delivered never stops the thread).

One request's failure is its own: a request the engine finished with "error", or whose own
publishing here raised (its detokenisation), gets a last delta (finished, finish_reason "error") and
leaves the engine, its pages freed, while the others stream on. Only an error out of a whole step
(the device, the pool) stops the thread, and every waiting request then gets `EngineDead`.

Streamed text is the finished text's prefix: while a request runs, the last characters that could
still turn out to begin a stop string, and an unfinished UTF-8 sequence, are held back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kernels.compile_watch import WATCH
from target_service.engine.engine import LLMEngine
from target_service.engine.engine_client import EngineDead, EngineSnapshot, QueueFull, RequestDelta
from target_service.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the idle loop blocks on its command queue


@dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: object = None
    sent_tokens: int = 0
    sent_text: str = ""
    sent_prompt_logprobs: bool = False
    params: SamplingParams | None = field(default=None)


class AsyncEngine:
    """The in-process `EngineClient`."""

    check_blocks = False  # `check` reads the engine here (a grammar's compile aside: see `check`)

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 256):
        """engine: an `LLMEngine` this object takes over (no one else may call it afterwards)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio side -------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending_adds

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def snapshot(self) -> EngineSnapshot:
        """Counters, queue lengths and pool usage, read from another thread between steps' writes
        (each value is one read of a Python object: possibly a step old, never torn)."""
        engine = self.engine
        counters = engine.counters()
        return EngineSnapshot(engine.stats.copy(), self.num_running, self.num_waiting, engine.pool_usage(),
                              counters.num_steps, counters.num_steps_ahead, {"in_process": WATCH.counts()})

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse (ValueError) a request that could never run, before anything is queued: its prompt,
        and a structured output's grammar, which can take a while to compile (call it off the event
        loop for those)."""
        self.engine.check_request(prompt_token_ids, params)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas; closing the iterator early aborts the request."""
        if self._stopping.is_set():
            raise EngineDead("the engine is shutting down; it takes no new requests")
        if not self.is_healthy:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        self.engine.check_prompt(prompt_token_ids, params)  # a grammar is compiled by add_request
        request_id = request_id or f"req-{next(self._ids)}"
        with self._lock:
            if self.num_waiting >= self.max_waiting:
                raise QueueFull(self.num_waiting)
            self._pending_adds += 1
        tracked = _Tracked(asyncio.get_running_loop(), asyncio.Queue(), params=params)
        self._commands.put(("add", request_id, list(prompt_token_ids), params, tracked))
        finished = False
        try:
            while True:
                delta = await tracked.queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking work; in-flight requests finish first (drain), then the thread ends."""
        self._stopping.set()
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._take_commands(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    self.engine.step()
                    self._publish()
                elif self._stopping.is_set() and self._commands.empty():
                    return
        except BaseException as error:  # report to every waiting request instead of hanging them
            logger.exception("engine thread stopped")
            self._error = error
            for tracked in self._tracked.values():
                _deliver(tracked, EngineDead(repr(error)))

    def _take_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command) -> None:
        if command[0] == "add":
            _, request_id, prompt, params, tracked = command
            with self._lock:
                self._pending_adds -= 1
            try:
                tracked.seq = self.engine.add_request(request_id, prompt, params)
            except ValueError as error:
                _deliver(tracked, error)
                return
            self._tracked[request_id] = tracked
        elif command[0] == "abort":
            request_id = command[1]
            if self._tracked.pop(request_id, None) is not None and self.engine.has_request(request_id):
                self.engine.abort(request_id)

    def _publish(self) -> None:
        """Post every tracked request's new tokens and text, one hand-over per event loop (a step's
        deltas wake a loop once, not once per request); finished ones leave the engine. A request
        whose delta cannot be made fails alone."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, RequestDelta]]] = {}
        for request_id in list(self._tracked):
            tracked = self._tracked[request_id]
            try:
                delta = self._delta(request_id, tracked)
            except Exception as error:
                logger.error("request %s failed alone while publishing: %r", request_id, error,
                             exc_info=error)
                delta = self._failed(request_id, tracked)
            if delta is None:
                continue
            if delta.finished:
                del self._tracked[request_id]
            by_loop.setdefault(tracked.loop, []).append((request_id, tracked.queue, delta))
        for loop, posts in by_loop.items():
            if not _hand_over(loop, [(queue, delta) for _, queue, delta in posts]):
                for request_id, _, _ in posts:
                    self._consumer_gone(request_id)

    def _consumer_gone(self, request_id: str) -> None:
        """The request's event loop has closed: no one can read it any more, so it leaves the engine."""
        logger.warning("request %s: its event loop closed before it finished; aborted", request_id)
        self._tracked.pop(request_id, None)
        if self.engine.has_request(request_id):
            self.engine.abort(request_id)

    def _delta(self, request_id: str, tracked: _Tracked) -> RequestDelta | None:
        """A request's new tokens and text since the last delta (None: nothing new); a finished one is
        released from the engine."""
        seq = tracked.seq
        new_tokens = seq.output_token_ids[tracked.sent_tokens:]
        if not new_tokens and not seq.finish_reason:
            return None
        text = self.engine.output_text(seq)
        if not seq.finish_reason:
            text = text[: len(text) - _held_back(text, tracked.params)]
        new_text = text[len(tracked.sent_text):] if text.startswith(tracked.sent_text) else ""
        delta = RequestDelta(request_id, list(new_tokens), new_text,
                             finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
                             num_prompt_tokens=len(seq.prompt_token_ids),
                             num_output_tokens=len(seq.output_token_ids))
        self._add_logprobs(delta, seq, tracked)
        if delta.finished:
            delta.spec_decode = seq.spec_decode.copy()
            self.engine.release(request_id)
        tracked.sent_tokens += len(new_tokens)
        tracked.sent_text += new_text
        return delta

    @staticmethod
    def _add_logprobs(delta: RequestDelta, seq, tracked: _Tracked) -> None:
        """The logprobs of the delta's tokens, and the prompt's once (a request that asked)."""
        first = tracked.sent_tokens
        if seq.output_logprobs is not None:
            delta.logprobs = list(seq.output_logprobs[first: first + len(delta.token_ids)])
        first_with_tokens = delta.token_ids or delta.finished
        if seq.prompt_logprobs is not None and not tracked.sent_prompt_logprobs and first_with_tokens:
            delta.prompt_logprobs = list(seq.prompt_logprobs)
            tracked.sent_prompt_logprobs = True

    def _failed(self, request_id: str, tracked: _Tracked) -> RequestDelta:
        """The last delta of a request whose publishing failed: it leaves the engine (an unfinished
        one is aborted, which frees its pages) and ends with "error"."""
        if self.engine.has_request(request_id):
            self.engine.abort(request_id, reason="error")
        seq = tracked.seq
        delta = RequestDelta(request_id, list(seq.output_token_ids[tracked.sent_tokens:]), "", finished=True,
                             finish_reason="error", num_prompt_tokens=len(seq.prompt_token_ids),
                             num_output_tokens=len(seq.output_token_ids), spec_decode=seq.spec_decode.copy())
        self._add_logprobs(delta, seq, tracked)
        return delta


def _deliver(tracked: _Tracked, item) -> bool:
    """Hand `item` to the request's queue on its event loop; False when that loop has closed."""
    return _hand_over(tracked.loop, [(tracked.queue, item)])


def _hand_over(loop: asyncio.AbstractEventLoop, posts: list[tuple[asyncio.Queue, object]]) -> bool:
    """Put each item on its queue, on `loop`, in one callback; False when that loop has closed."""
    try:
        loop.call_soon_threadsafe(_put_all, posts)
    except RuntimeError:  # asyncio's "Event loop is closed"
        return False
    return True


def _put_all(posts: list[tuple[asyncio.Queue, object]]) -> None:
    for request_queue, item in posts:
        request_queue.put_nowait(item)


def _held_back(text: str, params: SamplingParams) -> int:
    """Characters at the end of a running request's text that may still change or be cut."""
    hold = max((len(stop) - 1 for stop in params.stop), default=0)
    trailing = len(text) - len(text.rstrip("\ufffd"))  # an unfinished multi-byte character
    return min(len(text), max(hold, trailing))

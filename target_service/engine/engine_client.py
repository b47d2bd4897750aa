"""EngineClient: what the HTTP server, the metrics and the drain ask of an engine, wherever it runs.

Two engines satisfy it: `AsyncEngine` (the engine in this process, its step loop in a thread) and
`RemoteEngine` (the engine in the target service's Ray actor). The server is written against this
protocol alone, so the HTTP contract is the same either way; a test holds both to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kernels.compile_watch import CompileCounts
from target_service.engine.outputs import SpecDecodeStats, TokenLogprob
from target_service.engine.sampling_params import SamplingParams


class QueueFull(RuntimeError):
    """Too many requests are waiting; retry after `retry_after_s`."""

    def __init__(self, waiting: int, retry_after_s: int = 1):
        super().__init__(f"{waiting} requests are already waiting for the engine; retry later")
        self.waiting = waiting
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # it crosses from the target service to the replica as it is
        return QueueFull, (self.waiting, self.retry_after_s)


class EngineDead(RuntimeError):
    """The engine stopped (an error, or a shutdown); requests cannot be served."""


@dataclass
class RequestDelta:
    """What one request gained in one step (the last one has `finished` set and the totals).

    For a request that asked: `logprobs`, one per token id of this delta; `prompt_logprobs`, the
    prompt's (the first None), on the first delta that carries a token (or the last, if none does).
    Plain data: across the Ray services it is pickled as it is.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """What the metrics read at a scrape: the speculative counters, the queue, the pool, and the
    Triton kernels each process of the engine built (`compilations`, by service: "in_process" for
    the one process of an in-process engine; "kvpool", "drafter", "target" for the Ray services)."""

    stats: SpecDecodeStats
    num_running: int
    num_waiting: int
    pool: object  # kvpool_service.control.PoolUsage
    num_steps: int = 0  # engine steps read
    num_steps_ahead: int = 0  # ... of which queued before the step before them was read
    compilations: dict[str, CompileCounts] = field(default_factory=dict)


@runtime_checkable
class EngineClient(Protocol):
    check_blocks: bool  # `check` waits on another process: callers on an event loop run it in a thread

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse (ValueError) a request that could never run, before anything is queued."""
        ...

    def snapshot(self) -> EngineSnapshot: ...

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas; closing the iterator early aborts the request. Raises
        QueueFull (retry later) or EngineDead before the first delta."""
        ...

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let those in flight finish (up to `timeout`), release the engine."""
        ...

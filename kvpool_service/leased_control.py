"""LeasedPoolControl: a PoolControl that keeps the block-table traffic off the step's critical path.

Over gRPC every verb is a round trip (about half a millisecond on loopback, more across hosts), and
the scheduler calls reserve and commit on every step. This wrapper, over any PoolControl (normally
the `KVPoolClient`), makes most steps call none:

  - reserve is leased: the pool is asked for `lease_tokens` more than wanted, so the next steps'
    reserves fit the capacity already granted and are answered here ([] appended, as the pool
    would answer). Sequences low on lease (under half of `lease_tokens` left) are topped up in the
    same RPC, so renewals bunch into one call instead of one per sequence. Every block the pool
    grants is returned at once, leased ones included: the caller extends its block table with
    them, so its table stays equal to the pool's. If the leased ask finds the pool exhausted, the
    exact ask is tried before PoolExhausted reaches the caller;
  - commit and close are queued and sent in order by a `PoolWriter` thread: the step goes on while
    the RPC is in flight (the forward of the next step overlaps it);
  - open, stats and a reserve the pool must grant first wait for that queue (a close must reach the
    pool before an open that needs its pages); an empty queue costs one attribute read.

An error of a queued call is raised, with its own type, by the next call of any verb (which then
does nothing); `flush()` waits for the queue and raises it too. Leased pages are held by their
sequence until it closes: they cannot be lent to another, so a nearly full pool preempts or refuses
admission a little sooner than without leases (by at most `lease_tokens` per running sequence).

One caller thread (the scheduler's). `inner` is only ever called by one thread at a time: this one
after the queue drained, or the writer's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool_service.control import (
    CommitRequest,
    OpenRequest,
    OpenResult,
    PoolControl,
    PoolLimits,
    PoolUsage,
    ReserveRequest,
)
from kvpool_service.errors import PoolExhausted
from kvpool_service.pool_writer import PoolWriter, WriterStats


@dataclass
class LeaseStats:
    """Counters of the caller's thread (the writer's own are `WriterStats`, in `writer`)."""

    writer: WriterStats
    reserves_total: int = 0  # reserve calls
    reserves_answered_locally: int = 0  # ... answered from leased capacity, no RPC
    reserve_fallbacks: int = 0  # leased asks refused (PoolExhausted) and retried exact
    blocking_rpcs: int = 0  # calls of inner made by the caller's thread (limits at start included)
    blocking_s: float = 0.0  # time spent in them
    drains: int = 0  # calls that had to wait for queued commits and closes
    drain_s: float = 0.0  # time spent waiting

    @property
    def async_rpcs(self) -> int:
        return self.writer.async_rpcs


class LeasedPoolControl:
    """`inner` with leased reserves and asynchronous, ordered commits and closes."""

    def __init__(self, inner: PoolControl, *, lease_tokens: int):
        if type(lease_tokens) is not int or lease_tokens < 0:
            raise ValueError(f"lease_tokens must be an int >= 0, got {lease_tokens!r}")
        self.inner = inner
        self.lease_tokens = lease_tokens
        self._writer: PoolWriter | None = None
        self.lease_stats = LeaseStats(writer=WriterStats())
        self._limits: PoolLimits = self._blocking(inner.limits)
        self._writer = PoolWriter(inner, max_num_seqs=self._limits.max_num_seqs)
        self.lease_stats.writer = self._writer.stats
        # seq_id -> the block table the pool holds for it (what the caller was handed).
        self._tables: dict[int, list[int]] = {}

    # ---- the PoolControl verbs --------------------------------------------------------------------

    def open(self, requests: Sequence[OpenRequest]) -> list[OpenResult]:
        self._settle()
        results = self._blocking(self.inner.open, requests)
        for result in results:
            self._tables[result.seq_id] = list(result.block_table)
        self._writer.opened(results)
        return results

    def reserve(self, requests: Sequence[ReserveRequest]) -> list[list[int]]:
        self._raise_pending()
        self.lease_stats.reserves_total += 1
        ask = self._plan_reserve(requests)
        if ask is None:  # unknown to us or malformed: the pool judges the call as it is
            self._settle()
            appended = self._blocking(self.inner.reserve, requests)
            for (seq_id, _), new in zip(requests, appended):
                if type(seq_id) is int and seq_id in self._tables:
                    self._tables[seq_id].extend(new)
            return appended
        if not ask:
            self.lease_stats.reserves_answered_locally += 1
            return [[] for _ in requests]
        self._settle()
        max_len = self._limits.max_model_len
        leased = [ReserveRequest(requests[i][0], min(requests[i][1] + self.lease_tokens, max_len))
                  for i in ask]
        try:
            granted = self._blocking(self.inner.reserve, leased)
        except PoolExhausted:
            ask = [i for i in ask if requests[i][1] > self._capacity(requests[i][0])]
            exact = [ReserveRequest(*requests[i]) for i in ask]
            if exact == leased:
                raise
            self.lease_stats.reserve_fallbacks += 1
            granted = self._blocking(self.inner.reserve, exact)
        appended: list[list[int]] = [[] for _ in requests]
        for i, new in zip(ask, granted):
            self._tables[requests[i][0]].extend(new)
            appended[i] = new
        return appended

    def commit(self, requests: Sequence[CommitRequest]) -> None:
        self._raise_pending()
        if self._writer.stopped:
            self._blocking(self.inner.commit, requests)
        elif requests:
            self._writer.put("commit", list(requests))

    def close(self, seq_ids: Sequence[int]) -> None:
        self._raise_pending()
        for seq_id in seq_ids:
            if type(seq_id) is int:  # anything else the pool will name
                self._tables.pop(seq_id, None)
        if self._writer.stopped:
            self._blocking(self.inner.close, seq_ids)
        elif seq_ids:
            self._writer.put("close", list(seq_ids))

    def stats(self) -> PoolUsage:
        self._settle()
        return self._blocking(self.inner.stats)

    def limits(self) -> PoolLimits:
        """Read once at construction: a pool's sizes do not change while it lives."""
        self._raise_pending()
        return self._limits

    # ---- beyond the protocol ----------------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        """The block table the pool holds for `seq_id`, as granted through this wrapper."""
        return list(self._tables[seq_id])

    def flush(self) -> None:
        """Wait until every queued commit and close has been answered; raise the first error."""
        self._settle()

    def forget(self) -> None:
        """The pool restarted empty: drop every table and length this wrapper tracks, and the error
        of any call queued for the old pool (moot now)."""
        self._writer.drain()
        self._writer.take_error()
        self._tables.clear()
        self._writer.forget()

    def shutdown(self) -> None:
        """Flush and stop the writer; later commits and closes are plain blocking calls."""
        self._writer.shutdown()
        self._raise_pending()

    def __enter__(self) -> LeasedPoolControl:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ---- helpers ----------------------------------------------------------------------------------

    def _plan_reserve(self, requests: Sequence[ReserveRequest]) -> list[int] | None:
        """Indices to ask the pool for: [] when every request fits its lease (answer here), None when
        a request is for a sequence not opened here or is one the pool would refuse."""
        limits = self._limits
        if len(requests) > limits.max_num_seqs:
            return None
        tables, tpb, max_len = self._tables, limits.tokens_per_block, limits.max_model_len
        low_water = self.lease_tokens // 2
        seen, ask, short = set(), [], False
        for i, (seq_id, length) in enumerate(requests):
            table = tables.get(seq_id) if type(seq_id) is int else None
            if table is None or type(length) is not int or not 0 <= length <= max_len or seq_id in seen:
                return None
            seen.add(seq_id)
            capacity = len(table) * tpb
            if length > capacity:
                short = True
                ask.append(i)
            elif length + low_water > capacity and capacity < max_len:  # top up while asking anyway
                ask.append(i)
        return ask if short else []

    def _capacity(self, seq_id: int) -> int:
        return len(self._tables[seq_id]) * self._limits.tokens_per_block

    def _blocking(self, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.lease_stats.blocking_rpcs += 1
            self.lease_stats.blocking_s += time.perf_counter() - start

    def _settle(self) -> None:
        """Wait for queued commits and closes (they must reach the pool first); raise their error."""
        self._raise_pending()
        if self._writer is not None and not self._writer.idle:
            start = time.perf_counter()
            self._writer.drain()
            self.lease_stats.drains += 1
            self.lease_stats.drain_s += time.perf_counter() - start
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._writer is not None and (error := self._writer.take_error()) is not None:
            raise error

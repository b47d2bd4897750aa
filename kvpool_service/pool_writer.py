"""PoolWriter: a pool's commits and closes, sent in order by one background thread.

A commit only records what a step wrote and a close only releases pages; the step needs no answer
from either, so the caller queues them and goes on (`LeasedPoolControl` waits for the queue only
before a call whose answer depends on them: open, a reserve the pool must grant, stats).

Order is kept: one thread sends the queue front to back. When it falls behind, the commits waiting
in a row are folded into one RPC (a later commit of a sequence carries the earlier one's token ids
before its own), but only where the folded call is refused exactly when one of the calls in order
would be: each folded entry must not shrink what the pool already holds (the writer tracks the
lengths the pool has accepted, as the only writer of its sequences). A refused fold is resent call
by call, so the pool ends in the state, and the caller gets the error, the calls in order give.
A fold can change which of two identical blocks written in the same window is the one the prefix
cache keeps (the earlier sequence in the batch wins); hits do not change.

| state        | written by                          | read by       |
| ------------ | ----------------------------------- | ------------- |
| _queue       | put (caller), _run (worker)         | both, locked  |
| _committed   | opened (caller, while idle), worker | worker        |
| _errors      | worker                              | take_error    |
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool_service.control import CommitRequest, OpenResult, PoolControl
from kvpool_service.errors import PoolError, TransportError


@dataclass
class WriterStats:
    """Counted by the worker thread only."""

    async_rpcs: int = 0  # commit and close calls the worker made (a refused fold's resends included)
    commits_folded: int = 0  # queued commit calls that rode in another's RPC
    async_errors: int = 0  # errors the worker caught, each raised to the caller once


class PoolWriter:
    """Sends queued commits and closes to `inner` in order, on one daemon thread."""

    def __init__(self, inner: PoolControl, *, max_num_seqs: int):
        self.inner = inner
        self.stats = WriterStats()
        self._max_batch = max_num_seqs
        self._cond = threading.Condition()
        self._queue: list[tuple[str, list]] = []  # ("commit", requests) or ("close", seq_ids)
        self._unfinished = 0  # queued calls not yet sent (and answered); 0 means the worker is idle
        self._stopping = False
        self._errors: list[Exception] = []
        # seq_id -> (num_tokens, num_context) the pool holds, for deciding which commits may fold.
        self._committed: dict[int, tuple[int, int]] = {}
        self._thread = threading.Thread(target=self._run, name="kvpool-writer", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Everything queued has been sent and answered (a plain read: cheap on every step)."""
        return self._unfinished == 0

    @property
    def stopped(self) -> bool:
        return self._stopping

    def put(self, verb: str, payload: list) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the pool writer is shut down")
            self._queue.append((verb, payload))
            self._unfinished += 1
            self._cond.notify()

    def drain(self) -> None:
        """Wait until everything queued so far has been answered by the pool."""
        if self._unfinished:
            with self._cond:
                self._cond.wait_for(lambda: self._unfinished == 0)

    def opened(self, results: Sequence[OpenResult]) -> None:
        """Record what the pool holds for newly opened sequences. Call only while idle (after drain)."""
        for result in results:
            self._committed[result.seq_id] = (result.num_cached_tokens, result.num_cached_tokens)

    def forget(self) -> None:
        """Drop what the pool held (it restarted empty). Call only while idle."""
        self._committed.clear()

    def take_error(self) -> Exception | None:
        """The first error the worker caught since the last call (later ones attached as notes)."""
        if not self._errors:
            return None
        with self._cond:
            first, *later = self._errors
            self._errors = []
        add_note = getattr(first, "add_note", None)  # Python 3.11+
        for error in later if add_note else ():
            add_note(f"a later queued call failed too: {type(error).__name__}: {error}")
        return first

    def shutdown(self) -> None:
        """Send what is queued, then stop the thread. Idempotent."""
        self.drain()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # ---- the worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                items, self._queue = self._queue, []
            try:
                for verb, run in itertools.groupby(items, key=lambda item: item[0]):
                    payloads = [payload for _, payload in run]
                    if verb == "commit":
                        self._send_commits(payloads)
                    else:
                        for seq_ids in payloads:
                            self._send_one("close", seq_ids)
            finally:
                with self._cond:
                    self._unfinished -= len(items)
                    self._cond.notify_all()

    def _send_commits(self, batches: list[list]) -> None:
        """Consecutive queued commit calls: fold those that may fold, send the rest one by one."""
        group: list[list] = []
        folded: dict[int, list] = {}  # seq_id -> [num_tokens, num_context, token ids]
        for batch in batches:
            if not self._may_fold(batch, folded):
                self._send_group(group, folded)
                group, folded = [], {}
                if not self._may_fold(batch, folded):  # suspicious on its own: the pool judges it alone
                    self._send_one("commit", batch)
                    continue
            for seq_id, num_tokens, num_context, token_ids in batch:
                entry = folded.setdefault(seq_id, [0, 0, []])
                entry[0], entry[1] = num_tokens, num_context
                entry[2].extend(token_ids or ())
            group.append(batch)
        self._send_group(group, folded)

    def _may_fold(self, batch: list, folded: dict[int, list]) -> bool:
        """Whether the batch's entries, folded in, are refused exactly when sent in order would be."""
        if len(folded) + len(batch) > self._max_batch:
            return False
        seen = set()
        for request in batch:
            try:
                seq_id, num_tokens, num_context, token_ids = request
                len(token_ids or ())
            except (TypeError, ValueError):
                return False
            if (type(seq_id) is not int or type(num_tokens) is not int or type(num_context) is not int
                    or seq_id in seen):
                return False
            seen.add(seq_id)
            before = folded.get(seq_id) or self._committed.get(seq_id)
            if before is None or not (before[0] <= num_tokens and before[1] <= num_context <= num_tokens):
                return False
        return True

    def _send_group(self, group: list[list], folded: dict[int, list]) -> None:
        if len(group) <= 1:
            for batch in group:
                self._send_one("commit", batch)
            return
        requests = [CommitRequest(seq_id, *entry) for seq_id, entry in folded.items()]
        self.stats.async_rpcs += 1
        try:
            self.inner.commit(requests)
        except TransportError as error:  # the pool may or may not have applied it: never resend
            self._record(error)
        except PoolError:  # refused, nothing changed: the calls in order say which one is wrong
            for batch in group:
                self._send_one("commit", batch)
        except Exception as error:
            self._record(error)
        else:
            self.stats.commits_folded += len(group) - 1
            self._note_commit(requests)

    def _send_one(self, verb: str, payload: list) -> None:
        self.stats.async_rpcs += 1
        try:
            getattr(self.inner, verb)(payload)
        except Exception as error:
            self._record(error)
            return
        if verb == "commit":
            self._note_commit(payload)
        else:
            for seq_id in payload:
                self._committed.pop(seq_id, None)

    def _note_commit(self, requests: Sequence) -> None:
        for seq_id, num_tokens, num_context, _ in requests:
            self._committed[seq_id] = (num_tokens, num_context)

    def _record(self, error: Exception) -> None:
        self.stats.async_errors += 1
        with self._cond:
            self._errors.append(error)

"""Scheduler: continuous batching under one token budget, with preemption by recompute.

Each step it (1) grows the capacity of every decoding sequence to hold its verify block, preempting
the newest running sequences when pages run out, (2) continues running prefills in chunks, and
(3) admits waiting requests while slots, pages and the step's token budget allow. The pool it talks
to is anything with the BlockManager's batched verbs (the in-process manager or the gRPC client),
so the admission arithmetic is the pool's: target + draft bytes per token, counted once.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import PoolExhausted
from target_service.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillChunk:
    """Positions start .. start+num_tokens-1 of `seq` go through the target this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == self.seq.prefill_len


@dataclass(frozen=True)
class DecodeWork:
    """One speculative step of `seq`: verify `num_proposed` drafts (num_proposed + 1 rows), of which
    the first `num_draft` may be accepted.

    Every drafting sequence verifies the same K rows so that the step stays uniform (one CUDA graph);
    a sequence allowed fewer drafts (near its max_tokens) has the extra ones verified and ignored:
    causal attention keeps them out of the rows that count, so its tokens are the same.
    """

    seq: Sequence
    num_draft: int
    num_proposed: int


@dataclass
class SchedulerOutput:
    decodes: list[DecodeWork] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, pool, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_draft_tokens(self, seq: Sequence) -> int:
        """K for this step: no draft past max_model_len or past the request's max_tokens, and none
        for a sequence whose draft context has a gap (see `Sequence.has_context`)."""
        if not seq.has_context:
            return 0
        n = seq.num_computed
        remaining = seq.params.max_tokens - len(seq.output_token_ids)
        return max(0, min(self.num_speculative_tokens, self.max_model_len - n - 2, remaining - 1))

    def num_proposed_tokens(self, seq: Sequence, num_draft: int) -> int:
        """Drafts to verify: K for every sequence with context whose K + 1 rows fit max_model_len (the
        uniform step), whatever `num_draft` of them may count; else num_draft."""
        if seq.has_context and seq.num_computed + self.num_speculative_tokens + 2 <= self.max_model_len:
            return self.num_speculative_tokens
        return num_draft

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [seq for seq in self.running if not seq.is_prefilling]
        work = []
        for seq in decoding:
            num_draft = self.num_draft_tokens(seq)
            num_proposed = self.num_proposed_tokens(seq, num_draft)
            if num_proposed + 1 > budget:
                break
            budget -= num_proposed + 1
            work.append(DecodeWork(seq, num_draft, num_proposed))
        out.decodes = self._reserve(work, out.preempted)
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                chunk = min(budget, seq.prefill_len - seq.num_computed)
                out.prefills.append(PrefillChunk(seq, seq.num_computed, chunk))
                budget -= chunk
        if not out.preempted:
            out.prefills += self._admit(budget)
        return out

    def _reserve(self, work: list[DecodeWork], preempted: list[Sequence]) -> list[DecodeWork]:
        """Reserve every verify block in one call; preempt the newest running sequence until it fits."""
        while work:
            requests = [ReserveRequest(w.seq.seq_id, w.seq.num_computed + w.num_proposed + 1) for w in work]
            try:
                appended = self.pool.reserve(requests)
            except PoolExhausted:
                victim = max(self.running, key=lambda seq: seq.arrival)
                self._preempt(victim)
                preempted.append(victim)
                work = [w for w in work if w.seq is not victim]
                continue
            for w, new_blocks in zip(work, appended):
                w.seq.block_table.extend(new_blocks)
            return work
        return []

    def _preempt(self, seq: Sequence) -> None:
        logger.info("preempting request %s (recompute) to free pages", seq.request_id)
        self.pool.close([seq.seq_id])
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _admit(self, budget: int) -> list[PrefillChunk]:
        """Open waiting sequences (in arrival order) that fit in slots, pages and the budget."""
        candidates, estimate = [], budget
        for seq in self.waiting:
            if estimate <= 0 or len(self.running) + len(candidates) >= self.max_num_seqs:
                break
            candidates.append(seq)
            estimate -= seq.prefill_len  # an upper bound: prefix-cache hits only lower it
        results = self._open(candidates)
        chunks = []
        for seq, result in zip(candidates, results):
            self.waiting.popleft()
            seq.status, seq.slot = SequenceStatus.RUNNING, result.slot
            seq.block_table = list(result.block_table)
            seq.num_cached_tokens = seq.num_computed = result.num_cached_tokens
            seq.num_pool_known_tokens = seq.prefill_len
            self.running.append(seq)
            chunk = min(budget, seq.prefill_len - seq.num_computed)
            if chunk > 0:
                chunks.append(PrefillChunk(seq, seq.num_computed, chunk))
                budget -= chunk
        return chunks

    def _open(self, candidates: list[Sequence]) -> list:
        """One batched open; when pages are short, retry with fewer (the newest dropped first)."""
        while candidates:
            try:
                return self.pool.open(
                    [OpenRequest(seq.seq_id, seq.token_ids[: seq.prefill_len]) for seq in candidates]
                )
            except PoolExhausted:
                candidates.pop()
        return []

    # ---- after the step -------------------------------------------------------------------------

    def commit(self, seqs: list[Sequence]) -> None:
        """Tell the pool what this step wrote: target K/V and draft context up to num_computed."""
        requests = []
        for seq in seqs:
            known = seq.num_pool_known_tokens
            new_ids = seq.token_ids[known: seq.num_computed] if seq.num_computed > known else []
            if seq.has_context:
                seq.num_context = seq.num_computed
            requests.append(CommitRequest(seq.seq_id, seq.num_computed, seq.num_context, new_ids))
            seq.num_pool_known_tokens = max(known, seq.num_computed)
        if requests:
            self.pool.commit(requests)

    def requeue_all(self) -> list[Sequence]:
        """The pool restarted empty: every running sequence waits again, to be recomputed into the new
        pool (nothing is closed: the new pool never knew them). A sequence that finished in the step
        the old pool failed in just finishes. Returns the requeued sequences."""
        requeued = [seq for seq in self.running if not seq.finish_reason]
        for seq in self.running:
            if seq.finish_reason:
                seq.status = SequenceStatus.FINISHED
        for seq in sorted(requeued, key=lambda seq: seq.arrival, reverse=True):
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)
        self.running = []
        self.num_preemptions += len(requeued)
        return requeued

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is: a running one's pages and slot are released at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.pool.close([seq.seq_id])
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        self.pool.close([seq.seq_id for seq in seqs])
        for seq in seqs:
            self.running.remove(seq)
            seq.status = SequenceStatus.FINISHED

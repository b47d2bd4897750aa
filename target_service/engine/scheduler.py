"""Scheduler: continuous batching under one token budget, with preemption by recompute.

Each step it (1) grows the capacity of every decoding sequence to hold its verify block, preempting
the newest running sequences when pages run out, (2) continues running prefills in chunks, and
(3) admits waiting requests while sequence indices, pages and the step's token budget allow. The pool it talks
to is anything with the BlockManager's batched verbs (the in-process manager or the gRPC client),
so the admission arithmetic is the pool's: target + draft bytes per token, counted once.

With async scheduling the engine asks for the next step before the current one is read
(`schedule_ahead`): the step this scheduler would plan after it, planned now, when that is possible.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.errors import PoolExhausted
from target_service.engine.adaptive_speculation import AdaptiveSpeculation
from target_service.engine.draft_budget import DraftBudget
from target_service.engine.scheduler_output import DecodeWork, PrefillChunk, SchedulerOutput
from target_service.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, pool, *, max_num_seqs: int, max_num_batched_tokens: int, draft_budget: DraftBudget,
                 max_prefill_tokens_with_decodes: int | None = None,
                 speculation: AdaptiveSpeculation | None = None,
                 before_release: Callable[[], None] | None = None):
        """max_prefill_tokens_with_decodes: prompt tokens one step prefills while it also decodes or
        verifies (None: the rest of max_num_batched_tokens). Every running stream waits for the step,
        so a long prompt's chunk beside them is a gap in each of their streams.

        speculation: how many drafts each step verifies (None: K, always).

        before_release: called before any sequence's pages go back to the pool (it finished, was
        aborted or preempted), while they are still its own: the runner's `before_release`."""
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.draft_budget = draft_budget
        self.speculation = speculation
        self.before_release = before_release
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def max_model_len(self) -> int:
        return self.draft_budget.max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        return self.draft_budget.num_speculative_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def max_accepted(self, seq: Sequence) -> int:
        """Drafts that may count for `seq` this step (`DraftBudget`, and the request's own limit);
        none for a sequence whose draft context has a gap (`Sequence.has_context`)."""
        if not seq.has_context:
            return 0
        allowed = self.draft_budget.max_accepted(seq.num_computed, seq.num_remaining_tokens)
        own = seq.params.num_speculative_tokens
        return allowed if own is None else min(allowed, own)

    def step_drafts(self, seqs: list[Sequence], caps: list[int]) -> int:
        """The drafts this step verifies per sequence: K, or the adaptive choice for these rows (caps:
        each one's drafts that may count)."""
        if self.speculation is None or not seqs:
            return self.num_speculative_tokens
        return self.speculation.choose([self.speculation.outlook(seq.acceptance, cap)
                                        for seq, cap in zip(seqs, caps)])

    def num_verified(self, seq: Sequence, max_accepted: int, step_drafts: int | None = None) -> int:
        """Drafts to verify: the step's (default K) for every sequence with context whose rows fit
        max_model_len (the uniform step), whatever fewer of them may count; else max_accepted."""
        k = self.num_speculative_tokens if step_drafts is None else step_drafts
        if seq.has_context and self.draft_budget.verifies_full_block(seq.num_computed, k):
            return k
        return min(max_accepted, k)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [seq for seq in self.running if not seq.is_prefilling]
        caps = [self.max_accepted(seq) for seq in decoding]
        step_drafts = self.step_drafts(decoding, caps)
        work = []
        for seq, max_accepted in zip(decoding, caps):
            num_verified = self.num_verified(seq, max_accepted, step_drafts)
            if num_verified + 1 > budget:
                break
            budget -= num_verified + 1
            work.append(DecodeWork(seq, num_verified, max_accepted))
        out.decodes = self._reserve(work, out.preempted)
        if out.decodes and self.max_prefill_tokens_with_decodes is not None:
            budget = min(budget, self.max_prefill_tokens_with_decodes)
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                chunk = PrefillChunk.next_of(seq, budget)
                out.prefills.append(chunk)
                budget -= chunk.num_tokens
        if not out.preempted:
            out.prefills += self._admit(budget)
        return out

    def schedule_ahead(self, current: SchedulerOutput, verified: list[int]) -> SchedulerOutput | None:
        """The step after `current` (whose decodes verified `verified` drafts), planned before its
        results are read; None when that step cannot be known now.

        It is planned only when it is the step `schedule` would plan after `current` whatever
        `current` accepts: the same sequences, each verifying the step's k drafts (K, or the adaptive
        choice, made now from what is known; max_model_len far enough away; no request limiting its
        own drafts below k, a limit only the host applies), within the token budget, without
        preempting, nobody to admit (none waiting, or every sequence index taken: a request waiting
        for one that `current` frees is admitted a step later); and only for greedy requests or
        those with their own generator, so the engine's shared generator is never drawn for a step
        that is dropped. Pages are reserved for the longest outcome of
        `current` (every draft accepted). How many drafts may count is left to the device
        (`DraftBudget.max_accepted_on_device`): each decode's `max_accepted` here is only the bound k.
        """
        seqs = [work.seq for work in current.decodes]
        if current.prefills or current.preempted or not seqs:
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        if len(seqs) != len(self.running) or set(map(id, seqs)) != set(map(id, self.running)):
            return None
        # the caps before `current` is read: the choice's estimate; the device applies the rule
        k = self.step_drafts(seqs, [self.max_accepted(seq) for seq in seqs])
        if any(seq.params.num_speculative_tokens is not None and seq.params.num_speculative_tokens < k
               for seq in seqs):
            return None  # a request's own limit is the host's to apply
        if len(seqs) * (k + 1) > self.max_num_batched_tokens:
            return None
        requests = []
        for seq, drafted in zip(seqs, verified):
            longest = seq.num_computed + drafted + 1  # num_computed after `current` accepts every draft
            if k and not seq.has_context:
                return None
            if not (seq.params.greedy or seq.generator is not None):
                return None
            if not self.draft_budget.verifies_full_block(longest, k):
                return None  # `schedule` might verify fewer rows then
            requests.append(ReserveRequest(seq.seq_id, longest + k + 1))
        try:
            appended = self.pool.reserve(requests)
        except PoolExhausted:
            return None  # `schedule` would preempt: let it, after `current`
        for seq, blocks in zip(seqs, appended):
            seq.block_table.extend(blocks)
        return SchedulerOutput(decodes=[DecodeWork(seq, k, k) for seq in seqs])

    def _reserve(self, work: list[DecodeWork], preempted: list[Sequence]) -> list[DecodeWork]:
        """Reserve every verify block in one call; preempt the newest running sequence until it fits."""
        while work:
            requests = [ReserveRequest(w.seq.seq_id, w.seq.num_computed + w.num_verified + 1) for w in work]
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
        self._close([seq])
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _admit(self, budget: int) -> list[PrefillChunk]:
        """Open waiting sequences (in arrival order) that fit in sequence indices, pages and the budget."""
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
            seq.status, seq.seq_index = SequenceStatus.RUNNING, result.seq_index
            seq.block_table = list(result.block_table)
            # the pool opens a sequence with num_context = its cached tokens (a block is cached only
            # once its draft context is stored): start from the pool's count, which never shrinks
            seq.num_cached_tokens = seq.num_computed = seq.num_context = result.num_cached_tokens
            seq.num_pool_known_tokens = seq.prefill_len
            self.running.append(seq)
            if budget > 0:
                chunk = PrefillChunk.next_of(seq, budget)
                chunks.append(chunk)
                budget -= chunk.num_tokens
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
            new_ids = seq.token_slice(known, seq.num_computed) if seq.num_computed > known else []
            if seq.has_context:
                seq.num_context = seq.num_computed
            requests.append(CommitRequest(seq.seq_id, seq.num_computed, seq.num_context, new_ids))
            seq.num_pool_known_tokens = max(known, seq.num_computed)
        if requests:
            self.pool.commit(requests)

    def rebind(self, pool) -> list[Sequence]:
        """Work with a restarted (empty) pool from now on: every running sequence waits again, to be
        recomputed into it (nothing is closed: the new pool never knew them). A sequence that finished
        in the step the old pool failed in just finishes. Returns the requeued sequences."""
        self.pool = pool
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
        """Drop a request wherever it is: a running one's pages and index are released at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self._close([seq])
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        self._close(seqs)
        for seq in seqs:
            self.running.remove(seq)
            seq.status = SequenceStatus.FINISHED

    def _close(self, seqs: list[Sequence]) -> None:
        if self.before_release is not None:
            self.before_release()
        self.pool.close([seq.seq_id for seq in seqs])

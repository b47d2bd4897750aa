"""LLMEngine: the speculative step (reserve, propose, verify, accept, commit, store context).

One step runs every scheduled sequence through ONE target forward: prefill chunks and verify
blocks packed together. Decoding sequences first get K drafts from the drafter (context from the
pages, positions n..n+K for a sequence with n committed tokens); the target verifies
[bonus, d1..dK]; the longest agreeing prefix plus one target token is emitted; the taps of the
accepted rows (and of every prefill row) become draft context at their own positions.

The pool and the drafter sit behind the protocols the services meet through (`PoolControl`,
`DraftControl`); the drafter's inputs and drafts pass through the step buffers both sides map, so
splitting the services into processes changes nothing here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from drafter_service.control import DraftControl, DrafterUnavailable
from drafter_service.step_buffers import StepBuffers
from foundation.host_transfer import HostReadback, to_device
from kvpool_service.control import PoolLimits
from target_service.engine.outputs import SpecDecodeStats
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler import DecodeWork, PrefillChunk, Scheduler, SchedulerOutput
from target_service.engine.sequence import Sequence
from target_service.engine.stop_checker import StopChecker
from target_service.runner.context_rows import SeqTaps, select_context_rows
from target_service.runner.cuda_graphs import GraphKey, TargetGraphs
from target_service.runner.forward_batch import ForwardBatch, pack
from target_service.runner.sampling import choose_tokens
from target_service.runner.step_ahead import next_inputs, plan_ahead, uniform_decode_batch
from target_service.runner.step_layout import Rows, scheduled_layout, scheduled_seqs, uniform_layout
from target_service.runner.verify import DeviceDraftIndex

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step queued on the device whose results the host has not read yet."""

    plan: SchedulerOutput
    proposed: list[int]  # drafts verified per decode, in plan order
    num_drafts: list[int] | None  # ... of which may count; None: decided on the device (a step ahead)
    rows: dict[int, Rows]  # seq_id -> its rows in the packed forward
    targets: torch.Tensor  # the target's token at every logits row [R]
    accepted: torch.Tensor | None  # accepted drafts per decode; None: no drafts in the step
    readback: HostReadback  # targets then accepted, on their way to the host


class LLMEngine:
    def __init__(self, target, target_caches, scheduler: Scheduler, *, limits: PoolLimits,
                 drafter: DraftControl | None = None, step_buffers: StepBuffers | None = None,
                 stop_checker: StopChecker, seed: int | None = None, graphs: TargetGraphs | None = None,
                 async_scheduling: bool = True):
        self.target = target
        self.target_caches = target_caches
        self.scheduler = scheduler
        self.limits = limits
        self.tokens_per_block = limits.tokens_per_block
        self.drafter = drafter
        self.step_buffers = step_buffers
        self.graphs = graphs
        self.async_scheduling = async_scheduling
        self._ahead: _Launched | None = None  # the next step, launched before this one was read
        self.num_steps = 0  # steps read
        self.steps_ahead = 0  # ... of which launched ahead
        self.dropped_ahead = 0  # sequences whose step ahead was dropped (finished the step before)
        self.stop_checker = stop_checker
        self.device = target.embed_weight.device
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self.stats = SpecDecodeStats()
        self._next_seq_id = 0
        self._num_requests = 0
        self.sequences: dict[str, Sequence] = {}

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device)
            generator.manual_seed(params.seed)
        seq = Sequence(request_id, self._next_seq_id, list(prompt_token_ids), params, self._num_requests,
                       generator)
        self._next_seq_id += 1
        self._num_requests += 1
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse, at submission, a request that could never run (not mid-flight).

        Besides the prompt itself, the request's largest reservation (prompt + max_tokens + K,
        capped by max_model_len) must fit the pool alone, or preemption could never make room.
        """
        count, vocab = len(prompt_token_ids), self.target.config.vocab_size
        if count == 0:
            raise ValueError("the prompt is empty; at least one token is needed")
        bad = [token for token in prompt_token_ids if not 0 <= token < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        max_model_len = self.scheduler.max_model_len
        if count >= max_model_len:
            raise ValueError(f"the prompt has {count} tokens; max_model_len is {max_model_len} and one "
                             "position is needed for the first generated token")
        tokens = min(max_model_len, count + params.max_tokens + self.scheduler.num_speculative_tokens)
        blocks = self.limits.blocks_for(tokens)
        usable = self.limits.max_blocks_per_seq
        if blocks > usable:
            raise ValueError(f"the request needs up to {blocks} blocks ({count} prompt tokens, max_tokens "
                             f"{params.max_tokens}); the pool has {usable} for one request: give it more "
                             "kv_cache_memory or ask for fewer tokens")

    def abort(self, request_id: str) -> Sequence:
        """Cancel a request between steps (a client that went away): its pages are freed now, its
        tokens so far stay readable on the returned sequence (finish_reason "abort")."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            raise ValueError(f"request id {request_id!r} is not in the engine")
        if not seq.is_finished:
            self.scheduler.abort(seq)
            seq.finish_reason = "abort"  # a step launched ahead drops its results
        self._drop_stale_ahead()
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def rebind_pool(self, pool, target_caches, limits: PoolLimits,
                    graphs: TargetGraphs | None) -> list[Sequence]:
        """Move onto a restarted (empty) pool: new control, pages and graphs over them; every running
        sequence is recomputed into it (preempt-and-recompute). Returns the requeued sequences."""
        if limits != self.limits:
            raise ValueError(f"the restarted pool's limits {limits} differ from the engine's {self.limits}")
        self.scheduler.pool = pool
        self.target_caches, self.graphs = target_caches, graphs
        self._ahead = None  # its pages were the old pool's; its sequences are recomputed
        return self.scheduler.requeue_all()

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it.

        Everything up to the context store is queued on the device before the host reads anything:
        the drafts go from the step buffers into the forward's inputs and the accepted lengths into
        the context store on the device (`target_service.runner.verify`); the host reads the target's tokens
        and the accepted lengths once, while the GPU stores the context. With `async_scheduling`, the
        next step is queued before that read when its inputs follow from this step's device results
        (`target_service.runner.step_ahead`): the host then checks stops and commits while the GPU runs it.
        """
        launched = self._ahead or self._launch_scheduled()
        self._ahead = launched  # should launching the next one fail, the next call still reads this
        self._ahead = self._launch_ahead(launched) if self.async_scheduling else None
        finished = self._complete(launched)
        self._drop_stale_ahead()
        return finished

    def _launch_scheduled(self) -> _Launched:
        """Queue the step the scheduler plans now."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError("the scheduler found no work although requests are waiting")
        scheduled = scheduled_seqs(plan)
        proposed = self._propose(plan.decodes, scheduled)
        num_drafts = [min(work.num_draft, count) for work, count in zip(plan.decodes, proposed)]
        chunks, rows, index = scheduled_layout(plan, proposed, num_drafts, taps=self.drafter is not None,
                                               width=self._draft_width())
        batch = pack(chunks, self.tokens_per_block, self.device)
        verify = index.to_device(self.device) if index.num_draft_tokens else None
        return self._launch(plan, proposed, num_drafts, rows, batch, verify)

    def _launch_ahead(self, current: _Launched) -> _Launched | None:
        """Queue the step after `current` from its device results, when that is exactly the step the
        scheduler would plan next (`step_ahead.plan_ahead`); None otherwise."""
        num_draft = self.scheduler.num_speculative_tokens if self.drafter is not None else 0
        plan = plan_ahead(self.scheduler, current.plan, current.proposed, num_draft)
        if plan is None:
            return None
        seqs = [work.seq for work in plan.decodes]
        logit_starts = [current.rows[seq.seq_id].logits.start for seq in seqs]
        computed = [seq.num_computed for seq in seqs]  # where `current` started: it is not read yet
        remaining = [seq.params.max_tokens - len(seq.output_token_ids) for seq in seqs]  # before `current`
        logit_starts_d, starts_d, remaining_d, seq_slots_d = to_device(
            [logit_starts, computed, remaining, [seq.slot for seq in seqs]], torch.int64, self.device)
        columns = max(len(seq.block_table) for seq in seqs)
        padded = [seq.block_table + [0] * (columns - len(seq.block_table)) for seq in seqs]
        table = to_device(padded, torch.int32, self.device)
        bonus, starts, max_accepted = next_inputs(current.targets, current.accepted, logit_starts_d, starts_d,
                                                  remaining_d, num_draft, self.scheduler.max_model_len)
        if num_draft:
            self.step_buffers.stage_propose_tensors(bonus, starts, seq_slots_d, table)
            if not self._call_propose(len(seqs), num_draft, columns, seqs):
                return None
        self.steps_ahead += 1
        taps = self.drafter is not None
        batch = uniform_decode_batch(bonus, starts, table, num_draft, self.tokens_per_block, taps)
        rows, index = uniform_layout(seqs, num_draft, taps=taps, width=self._draft_width())
        verify = replace(index.to_device(self.device), max_accepted=max_accepted) if num_draft else None
        return self._launch(plan, [num_draft] * len(seqs), None, rows, batch, verify)

    def _launch(self, plan: SchedulerOutput, proposed: list[int], num_drafts: list[int] | None,
                rows: dict[int, Rows], batch: ForwardBatch, verify: DeviceDraftIndex | None) -> _Launched:
        """Queue a planned step's forward, its verification (None: no drafts) and its context store;
        start the read."""
        drafts = verify.place_drafts(self.step_buffers.draft_tokens, batch.input_ids) if verify else None
        output = self._forward(batch, plan, proposed)
        targets = self._target_tokens(output.logits, scheduled_seqs(plan), rows)
        accepted = verify.accepted_lengths(drafts, targets) if verify else None
        readback = HostReadback(targets if accepted is None else torch.cat([targets, accepted]))
        self._store_context(batch, output.taps, plan, rows, accepted)
        return _Launched(plan, proposed, num_drafts, rows, targets, accepted, readback)

    def _complete(self, launched: _Launched) -> list[Sequence]:
        """Read a launched step's tokens; emit, commit, and return the sequences that finished. A
        sequence already finished (in the step before, or aborted since) is left as it is: a step
        launched ahead ran it once too many, and those results are dropped."""
        values = launched.readback.tolist()
        self.num_steps += 1
        num_targets, plan = launched.targets.shape[0], launched.plan
        targets, accepted = values[:num_targets], values[num_targets:]
        live = [seq for seq in scheduled_seqs(plan) if not seq.finish_reason]
        self.dropped_ahead += len(plan.decodes) + len(plan.prefills) - len(live)
        num_drafts = launched.num_drafts  # a step ahead: what the device decided, from the same rule
        if num_drafts is None:
            num_drafts = [self.scheduler.num_draft_tokens(work.seq) for work in plan.decodes]
        for i, work in enumerate(plan.decodes):
            if not work.seq.finish_reason:
                self._accept(work, num_drafts[i], accepted[i] if accepted else 0,
                             targets[launched.rows[work.seq.seq_id].logits])
        for chunk in plan.prefills:
            if not chunk.seq.finish_reason:
                self._finish_prefill(chunk, targets[launched.rows[chunk.seq.seq_id].logits])
        self.scheduler.commit([seq for seq in live if not seq.finish_reason])
        finished = [seq for seq in live if seq.finish_reason]
        self.scheduler.finish(finished)
        return finished

    def _drop_stale_ahead(self) -> None:
        """A step launched ahead whose every sequence has finished has nothing left to read."""
        if self._ahead is not None and all(seq.finish_reason for seq in scheduled_seqs(self._ahead.plan)):
            self._ahead = None

    def _propose(self, decodes: list[DecodeWork], scheduled: list[Sequence]) -> list[int]:
        """Drafts per decode (0 for none) from one drafter call (K = the largest asked for), left in
        the step buffers' draft_tokens in the order of the decodes that draft; all 0 when the
        drafter is unavailable."""
        drafting = [work for work in decodes if work.num_proposed > 0]
        if self.drafter is None or not drafting:
            return [0] * len(decodes)
        num_draft = max(work.num_proposed for work in drafting)
        seqs = [work.seq for work in drafting]
        columns = self.step_buffers.stage_propose(
            [seq.bonus_token for seq in seqs], [seq.num_computed for seq in seqs], [seq.slot for seq in seqs],
            [seq.block_table for seq in seqs])
        if not self._call_propose(len(seqs), num_draft, columns, scheduled):
            return [0] * len(decodes)
        return [work.num_proposed for work in decodes]

    def _call_propose(self, num_seqs: int, num_draft: int, columns: int, scheduled: list[Sequence]) -> bool:
        """Ask the drafter for the staged rows' drafts; False (and `scheduled` go on plainly) when it
        is unavailable."""
        try:
            self.drafter.propose(num_seqs, num_draft, columns)
        except DrafterUnavailable as error:
            self._lose_context(scheduled, error)
            return False
        return True

    def _draft_width(self) -> int:
        return self.step_buffers.layout.max_num_draft if self.step_buffers is not None else 0

    def _forward(self, batch: ForwardBatch, plan: SchedulerOutput, proposed: list[int]):
        """The target's forward, replayed from a CUDA graph when the step is uniform: decodes only,
        every sequence verifying the same number of rows. Anything else runs eagerly."""
        if self.graphs is not None and plan.decodes and not plan.prefills:
            q_lens = {1 + count for count in proposed}
            if len(q_lens) == 1:
                output = self.graphs.run(batch, GraphKey(q_lens.pop(), taps=self.drafter is not None))
                if output is not None:
                    return output
        return self.target(batch, self.target_caches)

    def _target_tokens(self, logits: torch.Tensor, scheduled: list[Sequence], rows: dict[int, Rows]):
        """The target's token at every logits row [R], on the device: argmax, and a sample in the
        rows of each sampling request (its own generator, in the step's order)."""
        tokens = logits.argmax(dim=-1)
        for seq in scheduled:
            logit_rows = rows[seq.seq_id].logits
            if not seq.params.greedy and logit_rows.stop > logit_rows.start:
                tokens[logit_rows] = choose_tokens(logits[logit_rows], seq.params, self._generator(seq))
        return tokens

    def _accept(self, work: DecodeWork, num_draft: int, accepted: int, target_tokens: list[int]) -> None:
        """Commit one decode's verified rows: the bonus and `accepted` drafts; emit the target's
        tokens up to and including its first correction (or the token after the last draft)."""
        seq = work.seq
        self.stats.record(num_draft, accepted)
        seq.spec_decode.record(num_draft, accepted)
        seq.num_computed += accepted + 1
        self._emit(seq, target_tokens[: accepted + 1])

    def _finish_prefill(self, chunk: PrefillChunk, target_tokens: list[int]) -> None:
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.num_tokens
        if chunk.is_last and not seq.output_token_ids:
            self._emit(seq, target_tokens)

    def _store_context(self, batch: ForwardBatch, taps: torch.Tensor, plan: SchedulerOutput,
                       rows: dict[int, Rows], accepted: torch.Tensor | None) -> None:
        """One drafter call: every tap row of the step, rows past a decode's accepted prefix (and
        rows of sequences whose context has a gap) skipped.

        The rows are selected on the device (`target_service.runner.context_rows`): nothing waits for the GPU.
        """
        scheduled = scheduled_seqs(plan)
        if self.drafter is None or taps.shape[0] == 0 or not any(seq.has_context for seq in scheduled):
            return
        num_decodes = len(plan.decodes)
        seqs = [SeqTaps(rows[seq.seq_id].taps.stop - rows[seq.seq_id].taps.start, position < num_decodes,
                        seq.has_context, seq.slot) for position, seq in enumerate(scheduled)]
        positions, seq_slots, slots = select_context_rows(batch, seqs, accepted)
        try:
            self.drafter.settle()  # the last step's context may still be read from the buffers
            self.drafter.store_context(self.step_buffers.stage_context(taps, positions, seq_slots, slots))
        except DrafterUnavailable as error:
            self._lose_context(scheduled, error)

    def _lose_context(self, scheduled: list[Sequence], error: DrafterUnavailable) -> None:
        """The drafter missed this step: its sequences decode plainly from now on (lossless, as
        any draft is) until recomputed; new requests speculate once the drafter is back."""
        logger.warning("drafter unavailable (%s): %d sequences continue without speculation", error,
                       sum(seq.has_context for seq in scheduled))
        for seq in scheduled:
            seq.has_context = False

    # ---- helpers --------------------------------------------------------------------------------

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        """Append emitted tokens one by one until a stop condition ends the request."""
        for token in tokens:
            seq.output_token_ids.append(token)
            reason = self.stop_checker.check(seq, self.scheduler.max_model_len)
            if reason:
                seq.finish_reason = reason
                return

    def _generator(self, seq: Sequence) -> torch.Generator:
        return seq.generator if seq.generator is not None else self.generator

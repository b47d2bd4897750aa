"""ModelRunner: the device work of a step (propose, pack, forward, sample, verify, store context).

It turns a `SchedulerOutput` into work queued on the device and, later, into the plain ints the
engine's bookkeeping needs. One step runs every scheduled sequence through ONE target forward:
prefill chunks and verify blocks packed together. Decoding sequences first get their drafts from
the drafter (context from the pages, positions n..n+K for a sequence with n computed positions);
the target verifies [bonus, d1..dK]; the accepted lengths are worked out on the device
(`target_service.runner.verify`); the taps of the accepted rows (and of every prefill row) become
draft context at their own positions. The host reads the target's tokens and the accepted lengths
once, in `read`, while the GPU stores the context.

The pool's pages and the drafter sit behind what the services meet through (the target layers
mapped from a `PoolHandle`, `DraftControl`, the step buffers both sides map), so splitting the
services into processes changes nothing here. The runner reads sequences and writes only their
`has_context` (False when the drafter missed a step).

One request cannot fail the step: a sequence whose sampling raises is named in the step's `failed`
(the engine finishes it with an error) and its rows keep the argmax, so the device work after it
(verification, the context store, a step launched ahead) runs on valid tokens for everyone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from drafter_service.control import DraftControl, DrafterUnavailable
from drafter_service.step_buffers import StepBuffers
from foundation.host_transfer import HostReadback, to_device
from target_service.engine.draft_budget import DraftBudget
from target_service.engine.scheduler_output import DecodeWork, SchedulerOutput
from target_service.engine.sequence import Sequence
from target_service.engine.step_runner import StepTokens
from target_service.proposers.token_proposer import DFLASH, TokenProposer, stage_propose_side
from target_service.runner.constrained_step import ConstrainedStep, mask_executor
from target_service.runner.context_rows import SeqTaps, context_rows, stage_context_rows
from target_service.runner.cuda_graphs import GraphKey, TargetGraphs
from target_service.runner.forward_batch import ForwardBatch, pack
from target_service.runner.logprobs import StepLogprobs, gather_logprobs, plan_logprob_rows
from target_service.runner.sampling import choose_tokens
from target_service.runner.step_layout import Rows, scheduled_layout, uniform_layout
from target_service.runner.uniform_step import next_inputs, uniform_decode_batch
from target_service.runner.verify import DeviceDraftIndex

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    plan: SchedulerOutput
    verified: list[int]  # drafts verified per decode, in plan order
    max_accepted: list[int] | None  # ... of which may count; None: decided on the device (a step ahead)
    rows: dict[int, Rows]  # seq_id -> its rows in the packed forward
    targets: torch.Tensor  # the target's token at every logits row [R]
    accepted: torch.Tensor | None  # accepted drafts per decode; None: no drafts in the step
    readback: HostReadback  # targets then accepted, on their way to the host
    failed: dict[int, Exception] = field(default_factory=dict)  # seq_id -> why its sampling failed
    logprobs: StepLogprobs | None = None  # the asking requests' logprobs, on their way; None: nobody asked
    proposers: list[str | None] = field(default_factory=list)  # per decode: who drafted (None: no drafts)


class ModelRunner:
    """The engine's `StepRunner`: the target model over the pool's pages, the drafter, the graphs."""

    def __init__(self, target, target_caches, *, tokens_per_block: int, draft_budget: DraftBudget,
                 drafter: DraftControl | None = None, step_buffers: StepBuffers | None = None,
                 graphs: TargetGraphs | None = None, seed: int | None = None):
        self.target = target
        self.target_caches = target_caches
        self.tokens_per_block = tokens_per_block
        self.draft_budget = draft_budget
        self.drafter = drafter
        self.step_buffers = step_buffers
        self.graphs = graphs
        self.device = target.embed_weight.device
        self.generator = torch.Generator(self.device)  # for sampled requests without a seed of their own
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self.num_steps_ahead = 0  # steps launched from the device results of the step before them
        self._mask_executor = mask_executor()  # its threads start with the first constrained step

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def make_generator(self, seed: int) -> torch.Generator:
        """A generator of a request's own (its `seed`), on the device the sampling runs on."""
        generator = torch.Generator(self.device)
        generator.manual_seed(seed % 2**64)  # torch's own map of negative seeds, made total
        return generator

    def rebind(self, target_caches, graphs: TargetGraphs | None) -> None:
        """Run over a restarted pool's pages (and graphs captured over them) from now on."""
        self.target_caches, self.graphs = target_caches, graphs
        if isinstance(self.drafter, TokenProposer):
            self.drafter.drop_deferred()

    def before_release(self) -> None:
        """The scheduler is about to hand some sequence's pages back to the pool: a proposer that
        holds context to store into them stores it now."""
        if isinstance(self.drafter, TokenProposer):
            self.drafter.before_release()

    def swap_drafter(self, drafter: DraftControl | None) -> DraftControl | None:
        """Propose with `drafter` from the next step on (a prompt-lookup double, or None for plain
        decoding); returns the one it replaces. Between requests only: sequences in flight keep
        context the new drafter never saw."""
        if drafter is not None and self.step_buffers is None:
            raise ValueError("this runner was built without a drafter: it has no step buffers to draft into")
        previous, self.drafter = self.drafter, drafter
        return previous

    def drop_graphs(self) -> None:
        """Free the graphs (they hold the old pages) before new ones are captured."""
        self.graphs = None

    # ---- launching --------------------------------------------------------------------------------

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Queue the step `plan` schedules: its drafts, forward, verification and context store."""
        verified, proposers = self._propose(plan)
        max_accepted = [min(work.max_accepted, count) for work, count in zip(plan.decodes, verified)]
        chunks, rows, index = scheduled_layout(plan, verified, max_accepted, taps=self._taps,
                                               width=self._draft_width())
        batch = pack(chunks, self.tokens_per_block, self.device)
        verify = index.to_device(self.device) if index.num_draft_tokens else None
        return self._launch(plan, verified, max_accepted, rows, batch, verify, proposers)

    def launch_after(self, current: LaunchedStep, plan: SchedulerOutput) -> LaunchedStep | None:
        """Queue `plan`, the step after `current` (`Scheduler.schedule_ahead`), from `current`'s device
        results: its bonus tokens, starts and drafts that may count never reach the host. None when
        the drafter could not propose, or reads the host's tokens, which `current` has not delivered
        yet (the step is then scheduled as usual)."""
        if isinstance(self.drafter, TokenProposer) or any(seq.constraint is not None for seq in plan.seqs):
            return None  # (a grammar advances by the tokens `current` emits, on the host)
        seqs = [work.seq for work in plan.decodes]
        num_verified = plan.decodes[0].num_verified
        logit_starts = [current.rows[seq.seq_id].logits.start for seq in seqs]
        computed = [seq.num_computed for seq in seqs]  # where `current` started: it is not read yet
        remaining = [seq.num_remaining_tokens for seq in seqs]  # before `current`
        logit_starts_d, starts_d, remaining_d, seq_indices_d = to_device(
            [logit_starts, computed, remaining, [seq.seq_index for seq in seqs]], torch.int64, self.device)
        columns = max(len(seq.block_table) for seq in seqs)
        padded = [seq.block_table + [0] * (columns - len(seq.block_table)) for seq in seqs]
        table = to_device(padded, torch.int32, self.device)
        budget = replace(self.draft_budget, num_speculative_tokens=num_verified)  # the step's k (adaptive)
        bonus, starts, max_accepted = next_inputs(current.targets, current.accepted, logit_starts_d, starts_d,
                                                  remaining_d, budget)
        if num_verified:
            self.step_buffers.stage_propose_tensors(bonus, starts, seq_indices_d, table)
            if not self._call_propose(len(seqs), num_verified, columns, seqs):
                return None
        self.num_steps_ahead += 1
        taps = self._taps
        batch = uniform_decode_batch(bonus, starts, table, num_verified, self.tokens_per_block, taps)
        rows, index = uniform_layout(seqs, num_verified, taps=taps, width=self._draft_width())
        verify = replace(index.to_device(self.device), max_accepted=max_accepted) if num_verified else None
        proposers = [DFLASH if num_verified else None] * len(seqs)
        return self._launch(plan, [num_verified] * len(seqs), None, rows, batch, verify, proposers)

    def read(self, launched: LaunchedStep) -> StepTokens:
        """Wait for a launched step's tokens and accepted lengths (one read; a second for the
        logprobs, when a request asked) and hand them out."""
        values = launched.readback.tolist()
        num_targets, plan, rows = launched.targets.shape[0], launched.plan, launched.rows
        targets, accepted = values[:num_targets], values[num_targets:]
        logprobs = launched.logprobs.read() if launched.logprobs is not None else {}

        def per_seq(seqs: list[Sequence], kind: str) -> list | tuple:
            return [logprobs.get((seq.seq_id, kind)) for seq in seqs] if logprobs else ()

        decodes, prefills = [work.seq for work in plan.decodes], [chunk.seq for chunk in plan.prefills]
        return StepTokens(
            decode_tokens=[targets[rows[seq.seq_id].logits] for seq in decodes],
            accepted=accepted or [0] * len(plan.decodes),
            prefill_tokens=[targets[rows[seq.seq_id].logits] for seq in prefills],
            decode_logprobs=per_seq(decodes, "output"), prefill_logprobs=per_seq(prefills, "output"),
            prompt_logprobs=per_seq(prefills, "prompt"))

    def _launch(self, plan: SchedulerOutput, verified: list[int], max_accepted: list[int] | None,
                rows: dict[int, Rows], batch: ForwardBatch, verify: DeviceDraftIndex | None,
                proposers: list[str | None]) -> LaunchedStep:
        """Queue a planned step's forward, its verification (None: no drafts) and its context store;
        start the read."""
        buffers = self.step_buffers.draft_tokens if self.step_buffers is not None else None
        constrained = ConstrainedStep.begin(plan, verified, buffers, self._mask_executor)
        drafts = verify.place_drafts(self.step_buffers.draft_tokens, batch.input_ids) if verify else None
        output = self._forward(batch, plan, verified)
        targets, failed = self._target_tokens(output.logits, plan.seqs, rows, constrained)
        accepted = verify.accepted_lengths(drafts, targets) if verify else None
        readback = HostReadback(targets if accepted is None else torch.cat([targets, accepted]))
        logprob_rows = plan_logprob_rows(plan, rows)  # outside any graph: from the logits it returned
        logprobs = gather_logprobs(output.logits, targets, logprob_rows) if logprob_rows else None
        self._store_context(batch, output.taps, plan, rows, accepted)
        return LaunchedStep(plan, verified, max_accepted, rows, targets, accepted, readback, failed, logprobs,
                            proposers)

    def step_took(self, launched: LaunchedStep, seconds: float) -> None:
        """A decode-only step that followed the one before without a gap took `seconds`: a token
        proposer that weighs what steps cost (the hybrid) learns it, for a step it drafted."""
        if isinstance(self.drafter, TokenProposer) and any(launched.proposers):
            self.drafter.step_took(len(launched.plan.decodes), seconds)

    # ---- the drafter ------------------------------------------------------------------------------

    def _propose(self, plan: SchedulerOutput) -> tuple[list[int], list[str | None]]:
        """Drafts verified per decode (0 for none) from one drafter call (K = the largest asked for),
        left in the step buffers' draft_tokens in the order of the decodes that draft; all 0 when the
        drafter is unavailable. And who drafted each decode (None: it verifies nothing)."""
        drafting: list[DecodeWork] = [work for work in plan.decodes if work.num_verified > 0]
        nothing = [0] * len(plan.decodes), [None] * len(plan.decodes)
        if self.drafter is None or not drafting:
            return nothing
        num_verified = max(work.num_verified for work in drafting)
        seqs = [work.seq for work in drafting]
        if isinstance(self.drafter, TokenProposer):  # it stages the propose side if it reads it
            self.drafter.stage_sequences(seqs)
            columns = max(len(seq.block_table) for seq in seqs)
        else:
            columns = stage_propose_side(self.step_buffers, seqs)
        if not self._call_propose(len(seqs), num_verified, columns, plan.seqs):
            return nothing
        token_proposer = isinstance(self.drafter, TokenProposer)
        names = iter(self.drafter.sources if token_proposer else [DFLASH] * len(seqs))
        return ([work.num_verified for work in plan.decodes],
                [next(names) if work.num_verified > 0 else None for work in plan.decodes])

    def _call_propose(self, num_seqs: int, num_draft: int, columns: int, scheduled: list[Sequence]) -> bool:
        """Ask the drafter for the staged rows' drafts; False (and `scheduled` go on plainly) when it
        is unavailable."""
        try:
            self.drafter.propose(num_seqs, num_draft, columns)
        except DrafterUnavailable as error:
            self._lose_context(scheduled, error)
            return False
        return True

    def _store_context(self, batch: ForwardBatch, taps: torch.Tensor, plan: SchedulerOutput,
                       rows: dict[int, Rows], accepted: torch.Tensor | None) -> None:
        """One drafter call: the step's tap rows, rows past a decode's accepted prefix (and rows of
        sequences whose context has a gap) skipped.

        On a GPU the rows are selected on the device (`target_service.runner.context_rows`): nothing
        waits for it.
        """
        scheduled = plan.seqs
        if not self._taps or taps.shape[0] == 0 or not any(seq.has_context for seq in scheduled):
            return
        num_decodes = len(plan.decodes)
        seqs = [SeqTaps(rows[seq.seq_id].taps.stop - rows[seq.seq_id].taps.start, position < num_decodes,
                        seq.has_context, seq.seq_index) for position, seq in enumerate(scheduled)]
        context = context_rows(batch, seqs, accepted, taps)
        try:
            if isinstance(self.drafter, TokenProposer) and self.drafter.defers_context(
                    taps.shape[0], context.count, prefill_only=not plan.decodes):
                self.drafter.defer_context(context, scheduled)  # (it may have stored what it held)
                return
            self.drafter.settle()  # the last step's context may still be read from the buffers
            self.drafter.store_context(stage_context_rows(self.step_buffers, context.taps, [context.rows]))
        except DrafterUnavailable as error:
            self._lose_context(scheduled, error)

    def _lose_context(self, scheduled: list[Sequence], error: DrafterUnavailable) -> None:
        """The drafter missed this step: its sequences decode plainly from now on (lossless, as
        any draft is) until recomputed; new requests speculate once the drafter is back."""
        logger.warning("drafter unavailable (%s): %d sequences continue without speculation", error,
                       sum(seq.has_context for seq in scheduled))
        for seq in scheduled:
            seq.has_context = False

    @property
    def _taps(self) -> bool:
        """Whether a step taps the target's hidden states: the draft context is made of them (prompt
        lookup alone keeps none)."""
        if isinstance(self.drafter, TokenProposer):
            return self.drafter.stores_context
        return self.drafter is not None

    def _draft_width(self) -> int:
        return self.step_buffers.layout.max_num_draft if self.step_buffers is not None else 0

    # ---- the target -------------------------------------------------------------------------------

    def _forward(self, batch: ForwardBatch, plan: SchedulerOutput, verified: list[int]):
        """The target's forward, replayed from a CUDA graph when the step is uniform: decodes only,
        every sequence verifying the same number of rows. Anything else runs eagerly."""
        if self.graphs is not None and plan.decodes and not plan.prefills:
            q_lens = {1 + count for count in verified}
            if len(q_lens) == 1:
                output = self.graphs.run(batch, GraphKey(q_lens.pop(), taps=self._taps))
                if output is not None:
                    return output
        return self.target(batch, self.target_caches)

    def _target_tokens(self, logits: torch.Tensor, scheduled: list[Sequence], rows: dict[int, Rows],
                       constrained: ConstrainedStep | None) -> tuple[torch.Tensor, dict[int, Exception]]:
        """The target's token at every logits row [R], on the device: argmax, and a sample in the
        rows of each sampling request (its own generator, in the step's order), both from the logits
        its grammar masks for a constrained request; and the sequences whose sampling failed
        (seq_id -> error), whose rows keep the argmax.

        Sampling already runs one request at a time (each has its own parameters and generator), so
        the failing row is the sequence whose call raised: no batched op has to be taken apart.
        What can only fail on the device, a distribution multinomial refuses, is ruled out before
        the op by `filter_logits`, which keeps every row valid by construction; a device-side assert
        could not be caught, and would end every request. An error is that sequence's alone only
        if the device still works afterwards (`_device_failed`); otherwise it ends the step.
        """
        tokens = logits.argmax(dim=-1)
        failed: dict[int, Exception] = {}
        for seq in scheduled:
            logit_rows = rows[seq.seq_id].logits
            masks = constrained is not None and constrained.masks(seq.seq_id)
            if logit_rows.stop <= logit_rows.start or (seq.params.greedy and not masks):
                continue  # the argmax stands: nothing to sample, nothing masked
            try:
                own = constrained.masked(seq.seq_id, logits[logit_rows]) if masks else logits[logit_rows]
                if seq.params.greedy:
                    tokens[logit_rows] = own.argmax(dim=-1)
                else:
                    generator = seq.generator if seq.generator is not None else self.generator
                    tokens[logit_rows] = choose_tokens(own, seq.params, generator)
            except Exception as error:
                if self._device_failed(error):
                    raise
                logger.warning("sampling failed for request %s alone: %r", seq.request_id, error)
                failed[seq.seq_id] = error
        return tokens, failed

    def _device_failed(self, error: Exception) -> bool:
        """Whether `error` is the device's (out of memory, or a CUDA context that no longer
        synchronises) rather than one request's."""
        if isinstance(error, torch.cuda.OutOfMemoryError):
            return True
        if self.device.type != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            return True
        return False

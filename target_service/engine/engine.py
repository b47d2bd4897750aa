"""LLMEngine: the books of the speculative step — schedule, run it on the device, accept, commit.

    step = scheduler.schedule() -> runner.launch(plan) -> runner.read(launched) -> accept, emit, commit

The device work (propose, pack, forward, verify, store context) is the runner's (`StepRunner`); what
is kept here is who runs, what each step accepted and emitted, and what the pool is told. With
async scheduling the next step is launched before this one is read, when the scheduler can plan it
now (`Scheduler.schedule_ahead`): the host then reads, checks stops and commits while the device
runs it; a sequence that finished in the step before has that step's results dropped.

One request cannot take the others down: when its part of a step raises (its sampling, which the
runner reports in the step's `failed`, or its acceptance, emission and stop check here), it alone
finishes with finish_reason "error" and its pages go back with the step's other finished ones; the
rest of the batch goes on, token for token as without it. A failure of the whole step (the device,
the pool) still raises out of `step`.

Everything callers read or do is a method or property here (requests, counts, stats, output text,
rebinding onto a restarted pool); nobody outside this room touches the scheduler or the sequences'
registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvpool_service.control import PoolControl, PoolLimits, PoolUsage
from kvpool_service.errors import StaleEpoch, TransportError
from target_service.engine.outputs import SpecDecodeStats, TokenLogprob
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler import Scheduler
from target_service.engine.scheduler_output import DecodeWork, PrefillChunk
from target_service.engine.sequence import Sequence
from target_service.engine.step_record import EngineCounters, StepRecord
from target_service.engine.step_runner import LaunchedStep, StepRunner
from target_service.engine.stop_checker import StopChecker
from target_service.structured.vocabulary import GrammarVocabulary

logger = logging.getLogger(__name__)

POOL_GONE = (TransportError, StaleEpoch)  # the pool's process died: a restarted one may take over


class LLMEngine:
    def __init__(self, runner: StepRunner, scheduler: Scheduler, *, limits: PoolLimits,
                 stop_checker: StopChecker, async_scheduling: bool = True,
                 on_pool_lost: Callable[[Exception], None] | None = None,
                 grammars: GrammarVocabulary | None = None):
        """on_pool_lost(error): called when a step finds the pool gone; it moves the engine onto the
        restarted pool (`rebind_pool`) or raises. None: the error propagates. grammars: compiles the
        structured outputs of requests (None: a target without a tokenizer, which refuses them)."""
        self._grammars = grammars
        self._runner = runner
        self._scheduler = scheduler
        self._limits = limits
        self._stop_checker = stop_checker
        self._async_scheduling = async_scheduling
        self._on_pool_lost = on_pool_lost
        self._ahead: LaunchedStep | None = None  # the next step, launched before this one was read
        self._sequences: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._num_dropped_ahead = 0
        self._num_pool_recoveries = 0
        self._steps = StepRecord()
        self.stats = SpecDecodeStats()  # engine-wide speculative counters
        # on_scheduled(request_id, time.monotonic()): told of every prefill chunk a step schedules, in
        # the engine's thread (the first call for a request is when it left the queue); None: no one
        self.on_scheduled: Callable[[str, float], None] | None = None

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        generator = self._runner.make_generator(params.seed) if params.seed is not None else None
        spec_decode = SpecDecodeStats.for_request(self.num_speculative_tokens,
                                                  per_step=params.spec_decode_per_step)
        structured = params.structured_outputs
        constraint = self._grammar_vocabulary().constraint(structured) if structured is not None else None
        seq = Sequence(request_id, self._next_seq_id, list(prompt_token_ids), params, self._next_seq_id,
                       generator, spec_decode=spec_decode, constraint=constraint)
        self._next_seq_id += 1
        self._sequences[request_id] = seq
        self._scheduler.add(seq)
        return seq

    def _grammar_vocabulary(self) -> GrammarVocabulary:
        if self._grammars is None:
            raise ValueError("structured outputs need the target's tokenizer (tokenizer.json); this target "
                             "has none")
        return self._grammars

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """`check_prompt`, and a structured output's grammar compiled against the tokenizer: all a
        server refuses before it queues (ValueError, one line). `add_request` compiles the grammar
        once itself, into the sequence's matcher."""
        self.check_prompt(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self._grammar_vocabulary().check(params.structured_outputs)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse, at submission, a request that could never run (not mid-flight).

        Besides the prompt itself, the request's largest reservation (prompt + max_tokens + K,
        capped by max_model_len) must fit the pool alone, or preemption could never make room.
        """
        count, vocab = len(prompt_token_ids), self._runner.vocab_size
        if count == 0:
            raise ValueError("the prompt is empty; at least one token is needed")
        bad = [token for token in prompt_token_ids if not 0 <= token < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        max_model_len = self.max_model_len
        if count >= max_model_len:
            raise ValueError(f"the prompt has {count} tokens; max_model_len is {max_model_len} and one "
                             "position is needed for the first generated token")
        tokens = min(max_model_len, count + params.max_tokens + self.num_speculative_tokens)
        blocks = self._limits.blocks_for(tokens)
        usable = self._limits.max_blocks_per_seq
        if blocks > usable:
            raise ValueError(f"the request needs up to {blocks} blocks ({count} prompt tokens, max_tokens "
                             f"{params.max_tokens}); the pool has {usable} for one request: give it more "
                             "kv_cache_memory or ask for fewer tokens")

    def abort(self, request_id: str, *, reason: str = "abort") -> Sequence:
        """Cancel a request between steps (a client that went away; `reason` "error": its caller's
        own work on it failed) and forget it: its pages are freed now, its tokens so far stay
        readable on the returned sequence (finish_reason `reason`, unless it had finished)."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            raise ValueError(f"request id {request_id!r} is not in the engine")
        if not seq.is_finished:
            self._scheduler.abort(seq)
            seq.finish_reason = reason  # a step launched ahead drops its results
        self._drop_stale_ahead()
        return seq

    def release(self, request_id: str) -> Sequence:
        """Forget a finished request (its caller has what it needs); returns its sequence."""
        seq = self._sequences.get(request_id)
        if seq is None:
            raise ValueError(f"request id {request_id!r} is not in the engine")
        if not seq.is_finished:
            raise ValueError(f"request {request_id!r} has not finished; abort it instead")
        del self._sequences[request_id]
        return seq

    @property
    def num_requests(self) -> int:
        """Requests the engine holds: unfinished ones, and finished ones not yet released."""
        return len(self._sequences)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._sequences

    def output_text(self, seq: Sequence) -> str:
        """A request's output as text: stop tokens dropped, cut before a stop string."""
        return self._stop_checker.output_text(seq)

    # ---- state ----------------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def max_model_len(self) -> int:
        return self._scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._runner.vocab_size

    @property
    def num_speculative_tokens(self) -> int:
        return self._scheduler.num_speculative_tokens

    @property
    def pool_limits(self) -> PoolLimits:
        """The pool's fixed geometry the engine admits against (blocks, tokens per block, ...)."""
        return self._limits

    def running_sequences(self) -> list[Sequence]:
        """The sequences scheduled now, in admission order (a copy of the list)."""
        return list(self._scheduler.running)

    def counters(self) -> EngineCounters:
        steps = self._steps
        return EngineCounters(steps.num_steps, self._runner.num_steps_ahead, self._num_dropped_ahead,
                              self._scheduler.num_preemptions, self._num_pool_recoveries,
                              dict(steps.iteration_tokens), dict(steps.decode_steps_by_drafts),
                              steps.slow_steps.count)

    def reset_stats(self) -> SpecDecodeStats:
        """Start the engine-wide speculative counters afresh; returns the ones so far."""
        previous, self.stats = self.stats, SpecDecodeStats()
        return previous

    def pool_usage(self) -> PoolUsage:
        return self._scheduler.pool.stats()

    def rebind_pool(self, pool: PoolControl, limits: PoolLimits) -> list[Sequence]:
        """Move onto a restarted (empty) pool: every running sequence is recomputed into it
        (preempt-and-recompute). The runner is moved onto its pages by whoever assembled it. Returns
        the requeued sequences."""
        if limits != self._limits:
            raise ValueError(f"the restarted pool's limits {limits} differ from the engine's {self._limits}")
        self._ahead = None  # its pages were the old pool's; its sequences are recomputed
        return self._scheduler.rebind(pool)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it. A step that finds the pool gone
        hands the error to `on_pool_lost` (which moves the engine onto the restarted pool) and
        finishes nothing."""
        try:
            return self._step()
        except POOL_GONE as error:
            if self._on_pool_lost is None:
                raise
            logger.warning("the pool went away mid-step (%s); recovering into the restarted pool", error)
            self._on_pool_lost(error)
            self._num_pool_recoveries += 1
            return []

    def _step(self) -> list[Sequence]:
        launched = self._ahead or self._launch_scheduled()
        self._ahead = launched  # should launching the next one fail, the next call still reads this
        self._ahead = self._launch_ahead(launched) if self._async_scheduling else None
        emitted = [len(seq.output_token_ids) for seq in launched.plan.seqs]
        finished = self._complete(launched)
        self._steps.gave_back(_tokens_given_back(launched.plan.seqs, emitted))
        self._drop_stale_ahead()
        if not self.has_unfinished:
            self._steps.went_idle()
        return finished

    def _launch_scheduled(self) -> LaunchedStep:
        plan = self._scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError("the scheduler found no work although requests are waiting")
        if self.on_scheduled is not None:
            now = time.monotonic()
            for chunk in plan.prefills:
                self.on_scheduled(chunk.seq.request_id, now)
        return self._runner.launch(plan)

    def _launch_ahead(self, current: LaunchedStep) -> LaunchedStep | None:
        plan = self._scheduler.schedule_ahead(current.plan, current.verified)
        return None if plan is None else self._runner.launch_after(current, plan)

    def _complete(self, launched: LaunchedStep) -> list[Sequence]:
        """Read a launched step's tokens; emit, commit, and return the sequences that finished. A
        sequence already finished (in the step before, or aborted since) is left as it is: a step
        launched ahead ran it once too many, and those results are dropped."""
        tokens = self._runner.read(launched)
        seconds = self._steps.read(launched.plan, launched.verified)
        if seconds is not None:
            self._learn_step_time(launched, seconds)
        plan = launched.plan
        live = [seq for seq in plan.seqs if not seq.finish_reason]
        self._num_dropped_ahead += len(plan.seqs) - len(live)
        failed = launched.failed  # seq_id -> error: that sequence's own part of the step failed
        for seq in live:
            if seq.seq_id in failed:
                self._fail(seq, failed[seq.seq_id])
        max_accepted = launched.max_accepted  # a step ahead: what the device decided, by the same rule
        if max_accepted is None:
            max_accepted = [min(self._scheduler.max_accepted(work.seq), work.num_verified)
                            for work in plan.decodes]
        for i, work in enumerate(plan.decodes):
            if not work.seq.finish_reason:
                self._isolated(work.seq, self._accept, work, max_accepted[i], tokens.accepted[i],
                               tokens.decode_tokens[i], _entry(tokens.decode_logprobs, i),
                               _entry(launched.proposers, i))
        for i, (chunk, chunk_tokens) in enumerate(zip(plan.prefills, tokens.prefill_tokens)):
            if not chunk.seq.finish_reason:
                self._isolated(chunk.seq, self._finish_prefill, chunk, chunk_tokens,
                               _entry(tokens.prefill_logprobs, i), _entry(tokens.prompt_logprobs, i))
        self._scheduler.commit([seq for seq in live if not seq.finish_reason])
        finished = [seq for seq in live if seq.finish_reason]
        self._scheduler.finish(finished)
        return finished

    def _learn_step_time(self, launched: LaunchedStep, seconds: float) -> None:
        """A decode-only step of one k that ran back to back took `seconds` (`StepRecord.read`):
        adaptive speculation and the runner's proposer learn what such a step costs."""
        speculation = self._scheduler.speculation
        if speculation is not None:
            speculation.step_took(len(launched.plan.decodes), launched.verified[0], seconds)
        self._runner.step_took(launched, seconds)

    def _isolated(self, seq: Sequence, work: Callable[..., None], *args) -> None:
        """Run one sequence's part of the step; should it raise, that sequence alone fails. The
        pool's loss is every sequence's, and propagates."""
        try:
            work(*args)
        except POOL_GONE:
            raise
        except Exception as error:
            self._fail(seq, error)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """Finish one sequence with "error"; the step's finish releases its pages."""
        logger.error("request %s failed alone and ends with an error: %r", seq.request_id, error,
                     exc_info=error)
        seq.finish_reason = "error"

    def _drop_stale_ahead(self) -> None:
        """A step launched ahead whose every sequence has finished has nothing left to read."""
        if self._ahead is not None and all(seq.finish_reason for seq in self._ahead.plan.seqs):
            self._ahead = None

    def _accept(self, work: DecodeWork, max_accepted: int, accepted: int, target_tokens: list[int],
                logprobs: list[TokenLogprob] | None, proposer: str | None) -> None:
        """Commit one decode's verified rows: the bonus and `accepted` drafts (`proposer`'s); emit the
        target's tokens up to and including its first correction (or the token after the last draft)."""
        seq = work.seq
        self.stats.record(max_accepted, accepted, proposer)
        seq.spec_decode.record(max_accepted, accepted, proposer)
        speculation = self._scheduler.speculation
        if speculation is not None and max_accepted > 0:
            if seq.acceptance is None:
                seq.acceptance = speculation.request_curve()
            speculation.observe(seq.acceptance, max_accepted, accepted)
        seq.num_computed += accepted + 1
        self._emit(seq, target_tokens[: accepted + 1], logprobs)

    def _finish_prefill(self, chunk: PrefillChunk, target_tokens: list[int],
                        logprobs: list[TokenLogprob] | None, prompt_logprobs: list[TokenLogprob] | None
                        ) -> None:
        """A chunk's positions are in the pages (a replayed chunk moves nothing back); the prompt
        logprobs it computed join the request's; the last chunk of a new request emits its first
        token."""
        seq = chunk.seq
        positions = chunk.prompt_logprob_positions
        if positions:
            known, computed = len(seq.prompt_logprobs), len(prompt_logprobs or ())
            if known != positions.start + 1 or computed != len(positions):
                raise RuntimeError(f"request {seq.request_id}: prompt logprobs out of step with its prefill")
            seq.prompt_logprobs.extend(prompt_logprobs)
        seq.num_computed = max(seq.num_computed, chunk.start + chunk.num_tokens)
        if chunk.is_last and not seq.output_token_ids:
            self._emit(seq, target_tokens, logprobs)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """Append emitted tokens (and, for a request that asked, their logprobs) one by one until a
        stop condition ends the request."""
        if seq.output_logprobs is not None and (logprobs is None or len(logprobs) < len(tokens)):
            raise RuntimeError(f"request {seq.request_id} asked for logprobs; the step returned none")
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            if seq.output_logprobs is not None:
                seq.output_logprobs.append(logprobs[i])
            reason = self._stop_checker.check(seq, self.max_model_len)
            if seq.constraint is not None and not reason:
                reason = _grammar_end(seq, token)
            if reason:
                seq.finish_reason = reason
                return


def _grammar_end(seq: Sequence, token: int) -> str | None:
    """A constrained request ends ("stop") once its grammar is complete, or where no token can continue
    it (the masks then allow only end-of-sequence, which an ignore_eos request does not stop at)."""
    if not seq.constraint.advance(token):
        logger.warning("request %s: its grammar cannot go on after token %d; it stops there",
                       seq.request_id, token)
        return "stop"
    return "stop" if seq.constraint.finished else None


def _entry(per_sequence, index: int):
    """One sequence's entry of a StepTokens logprobs list; None when the step returned none."""
    return per_sequence[index] if per_sequence else None


def _tokens_given_back(seqs: list[Sequence], emitted_before: list[int]) -> int:
    """A step's tokens as vLLM counts an iteration's: each token emitted, plus the whole prompt of each
    request that emitted its first token."""
    total = 0
    for seq, before in zip(seqs, emitted_before):
        new = len(seq.output_token_ids) - before
        total += new + (len(seq.prompt_token_ids) if new and not before else 0)
    return total

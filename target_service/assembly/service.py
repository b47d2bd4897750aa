"""TargetService: the target service in a process of its own (a Ray actor beside the pool and drafter).

It loads the target, maps the pool by handle, reaches the block manager only over gRPC (batched, and
leased ahead so most steps make no blocking call), creates the step buffers and the step channel the
drafter maps, and drives the drafter over that channel. Requests run over an `AsyncEngine` (the step
loop in its own thread): `generate` runs one to its end (the offline API; a cancelled call aborts
it), and the HTTP replica starts them with `start_request` and reads every request's deltas in
batches from one `deltas` stream (`DeltaOutbox`: one streamed item per request and step cost too
much CPU on both sides).

Peers are found through a `ServicePeers` (the Ray layer implements it by actor name), so this class
knows nothing of Ray. Faults it survives:
- the drafter dies, at any moment and whether or not Ray restarts it: the step channel sees its lock
  released, the engine goes on without speculation and the drafter is attached again when Ray has
  restarted it (`DrafterLink`). Attaching runs in a thread of its own, so finding a drafter that is
  restarting (or gone for good) never holds up a step;
- the pool dies: the first failed control call finds the restarted pool, the engine moves onto it and
  recomputes its running sequences (`LLMEngine`'s on_pool_lost, `_recover_pool` here);
- this process dies: Ray restarts it; finding the pool up, it starts at once and first releases the
  sequences its previous incarnation left open.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from drafter_service.channel_control import ChannelDraftControl
from foundation.gc_pauses import freeze_startup_heap
from foundation.step_channel import StepChannel
from kernels.compile_watch import WATCH, CompileCounts
from kvpool_service.assembler import PoolArgs
from kvpool_service.errors import PoolError
from kvpool_service.leased_control import LeasedPoolControl
from kvpool_service.metered_client import MeteredKVPoolClient
from kvpool_service.service import PoolInfo
from target_service.assembly.assembler import TargetAssembler
from target_service.assembly.delta_outbox import DeltaOutbox
from target_service.assembly.draft_link import DrafterLink
from target_service.assembly.plan import EnginePlan
from target_service.engine.async_engine import AsyncEngine
from target_service.engine.engine import POOL_GONE, LLMEngine
from target_service.engine.engine_client import EngineDead
from target_service.engine.outputs import SpecDecodeStats, TokenLogprob
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.step_record import EngineCounters

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TOKENS = 128  # capacity reserved ahead per sequence: one reserve RPC per 128 tokens
ATTACH_TIMEOUT_S = 300.0
POOL_RECOVERY_S = 300.0  # a pool that keeps dying is followed this long, then the engine stops
FOLLOW_POOL_S = 0.2  # between attempts to reach a pool that went away
DRAFT_CALL_TIMEOUT_S = 120.0  # a drafter alive but silent this long is treated as gone (the first
# propose may JIT-compile kernels for seconds)


class ServicePeers(Protocol):
    """How the target finds and asks the other two services (by actor name, under Ray)."""

    def pool_info(self, *, wait: bool) -> PoolInfo | None:
        """The pool's current incarnation; None when it was never started and wait is False."""
        ...

    def release_pool(self) -> int:
        """Close every sequence open in the pool (left by a previous incarnation of this service)."""
        ...

    def attach_drafter(self, pool_handle, step_handle, channel_handle):
        """Ask the drafter to serve these handles; returns a concurrent.futures.Future of its pid."""
        ...


@dataclass
class GenerationResult:
    """One finished request, as the offline API rebuilds its RequestOutput from it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TargetService:
    def __init__(self, plan: EnginePlan, peers: ServicePeers, *, pool_token: str | None = None,
                 lease_tokens: int = DEFAULT_LEASE_TOKENS, max_waiting: int = 256):
        """plan: the engine's plan as this actor runs it (`EnginePlan.for_ray_actors`)."""
        self.plan = plan
        self.peers = peers
        self.pool_token = pool_token
        self.lease_tokens = lease_tokens
        self.max_waiting = max_waiting
        self.assembler = TargetAssembler(plan).load()
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.link: DrafterLink | None = None
        self.control: LeasedPoolControl | None = None
        self.channel: StepChannel | None = None
        self.pool: PoolInfo | None = None
        self._attacher = ThreadPoolExecutor(1, thread_name_prefix="dflash-attach-drafter")  # one at a time
        self.outbox = DeltaOutbox(self._generate)  # streamed requests' deltas, batched for the replica
        if peers.pool_info(wait=False) is not None:  # restarted by Ray: the pool is already up
            self.start(restarted=True)

    # ---- assembly ---------------------------------------------------------------------------------

    def pool_args(self) -> PoolArgs:
        """What the pool service is built from: this pair's groups and the KV budget measured here."""
        return self.plan.pool_args(self.assembler.kv_budget(), share=True)

    def start(self, *, restarted: bool = False) -> int:
        """Attach to the pool and the drafter and start serving; returns this process's pid.
        restarted: Ray restarted this actor, so its peers may be restarting too. A pool that dies while
        it is being reached is followed to its next incarnation (as `_recover_pool` does), and a drafter
        that cannot be attached now is attached once it is back (as after its death): a start that
        raised would leave the actor dead for good. A first start fails on either, with its error."""
        if self.engine is not None:
            return os.getpid()
        self.pool, self.control = self._reach_pool(POOL_RECOVERY_S if restarted else 0.0)
        self.assembler.create_step_buffers(share=True)
        if self.plan.drafter_config is not None:
            self.channel = StepChannel.create(device=self.plan.device)
            block_size = self.plan.block_size
            control = ChannelDraftControl(self.channel, block_size, timeout_s=DRAFT_CALL_TIMEOUT_S)
            self.link = DrafterLink(control, self._reattach_drafter, block_size=block_size)
            if restarted:
                self.link.attach_again(ATTACH_TIMEOUT_S)
            else:
                self._reattach_drafter().result(ATTACH_TIMEOUT_S)
        self.engine = self.assembler.build(self.control, self.pool.handle, self.link,
                                           on_pool_lost=self._recover_pool)
        self.engine.on_scheduled = self.outbox.note_scheduled
        self._serve()
        freeze_startup_heap()  # collections walk only what serving allocates (`foundation.gc_pauses`)
        logger.info("target service (pid %d) serving on pool epoch %d", os.getpid(), self.pool.epoch)
        return os.getpid()

    def _serve(self) -> None:
        self.async_engine = AsyncEngine(self.engine, max_waiting=self.max_waiting)

    def _reach_pool(self, patience_s: float) -> tuple[PoolInfo, LeasedPoolControl]:
        """The pool's current incarnation, emptied of what an earlier target left open, and a control
        of it; a pool that dies meanwhile is followed to the next one for up to `patience_s`."""
        deadline = time.monotonic() + patience_s
        while True:
            pool = self.peers.pool_info(wait=True)
            try:
                released = self.peers.release_pool()
                if released:
                    logger.warning("released %d sequences a previous target left open in the pool", released)
                return pool, self._control(pool)
            except POOL_GONE as error:
                if time.monotonic() > deadline:
                    raise
                logger.warning("the pool (epoch %d) went away while starting (%s); following it", pool.epoch,
                               error)
                time.sleep(FOLLOW_POOL_S)

    def _control(self, pool: PoolInfo) -> LeasedPoolControl:
        client = MeteredKVPoolClient(pool.address, token=self.pool_token)
        try:
            client.connect()
        except PoolError:
            client.shutdown()
            raise
        return LeasedPoolControl(client, lease_tokens=self.lease_tokens)

    def _drop_control(self) -> None:
        """Let go of the control of a pool that is gone: its queued calls are moot."""
        try:
            self.control.forget()
            self.control.shutdown()
        except PoolError as error:
            logger.info("dropping the old pool's control: %s", error)
        self.control.inner.shutdown()

    def _reattach_drafter(self) -> Future:
        """Ask the drafter to attach to this target's pool, step buffers and channel; a future of its
        pid. In the attacher's thread: finding the drafter waits while Ray restarts it (and fails after
        a while when it is gone for good), and the step loop only polls the future (`DrafterLink`).
        Attempts run one after another, each with the pool as it is when the attempt starts."""
        return self._attacher.submit(self._attach_drafter)

    def _attach_drafter(self) -> int:
        buffers, channel = self.assembler.buffers.export(), self.channel.export()
        return self.peers.attach_drafter(self.pool.handle, buffers, channel).result(ATTACH_TIMEOUT_S)

    def _recover_pool(self, error: Exception) -> None:
        """The pool went away: move onto its next incarnation (or re-raise when it did not restart).
        A pool that dies again while the engine moves onto it is followed to the incarnation after,
        for up to POOL_RECOVERY_S: faults can come closer together than a move takes."""
        deadline = time.monotonic() + POOL_RECOVERY_S
        lost_epoch = self.pool.epoch
        while True:
            pool = self.peers.pool_info(wait=True)
            if pool.epoch == lost_epoch:
                raise error
            try:
                self._move_onto(pool)
                return
            except POOL_GONE as again:
                if time.monotonic() > deadline:
                    raise
                logger.warning("the restarted pool (epoch %d) went away too (%s); following it", pool.epoch,
                               again)
                lost_epoch, error = pool.epoch, again

    def _move_onto(self, pool: PoolInfo) -> None:
        control = self._control(pool)
        self._drop_control()
        self.pool, self.control = pool, control
        requeued = self.assembler.rebind(self.engine, self.control, pool.handle)
        if self.link is not None:  # the drafter's context lives in the new pool's spec layers now
            self.link.attach_again(ATTACH_TIMEOUT_S)
        freeze_startup_heap()  # thawed first: the old pool's mappings and graphs are collected
        logger.warning("moved onto the restarted pool (epoch %d): %d sequences are being recomputed",
                       pool.epoch, len(requeued))

    # ---- requests -----------------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> GenerationResult:
        """Run one request to completion; cancelling the call aborts it (its pages are freed)."""
        if self.async_engine is None:
            raise EngineDead("the target service has not started: its pool is not up yet")
        token_ids, text, last, logprobs, prompt_logprobs = [], [], None, None, None
        async for delta in self.async_engine.generate(prompt_token_ids, params, request_id):
            token_ids += delta.token_ids
            text.append(delta.text)
            if delta.logprobs is not None:
                logprobs = (logprobs or []) + delta.logprobs
            prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
            last = delta
        return GenerationResult(last.request_id, token_ids, "".join(text), last.finish_reason,
                                last.num_prompt_tokens, last.spec_decode or SpecDecodeStats(), logprobs,
                                prompt_logprobs)

    async def start_request(self, prompt_token_ids: list[int], params: SamplingParams,
                            request_id: str) -> None:
        """Start one request whose deltas (or error) leave through `deltas`; it never raises, so the
        replica need not wait for its answer."""
        if self.async_engine is None:
            self.outbox.fail(request_id, EngineDead("the target service has not started: its pool is not up"))
            return
        self.outbox.start(prompt_token_ids, params, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a streamed request (its client went away): its pages are freed before the next step."""
        return self.outbox.abort(request_id)

    async def deltas(self):
        """Every streamed request's deltas, in batches, for as long as the replica reads (a Ray
        streaming generator; its end aborts the requests still running: `DeltaOutbox`)."""
        async for batch in self.outbox.batches():
            yield batch

    def _generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        return self.async_engine.generate(prompt_token_ids, params, request_id)

    def snapshot(self) -> dict:
        """The counters and queue lengths the server's metrics and admission read."""
        engine = self._started_engine()
        counters = engine.counters()
        return {"stats": engine.stats.copy(), "num_running": engine.num_running,
                "num_waiting": self.async_engine.num_waiting, "healthy": self.async_engine.is_healthy,
                "num_steps": counters.num_steps, "num_steps_ahead": counters.num_steps_ahead}

    def compilations(self) -> CompileCounts:
        """Triton kernels this process built, before its engine was ready and since."""
        return WATCH.counts()

    def counters(self) -> EngineCounters:
        """How the engine's steps went (preemptions, tokens per step, ...), for the server's metrics."""
        return self._started_engine().counters()

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse (ValueError) a request that could never run, before anything runs."""
        self._started_engine().check_request(prompt_token_ids, params)

    def _started_engine(self) -> LLMEngine:
        if self.engine is None:
            raise EngineDead("the target service has not started: its pool is not up yet")
        return self.engine

    # ---- observing ----------------------------------------------------------------------------------

    def stats(self) -> SpecDecodeStats:
        return self._started_engine().stats.copy()

    def describe(self) -> dict:
        """Who this is and how its links fared: the pid, pool epoch, drafter faults, control traffic."""
        link, engine = self.link, self.engine
        counters = engine.counters() if engine else None
        return {
            "pid": os.getpid(),
            "pool_epoch": self.pool.epoch if self.pool else None,
            "pool_recoveries": counters.num_pool_recoveries if engine else 0,
            "drafter_available": link.available if link else None,
            "drafter_failures": link.num_failures if link else 0,
            "drafter_reattached": link.num_reattached if link else 0,
            "running": engine.num_running if engine else 0,
            "preemptions": counters.num_preemptions if engine else 0,
            "waiting": engine.num_waiting if engine else 0,
            "lease": self.control_stats() if self.control else None,
        }

    def control_stats(self) -> dict:
        """The control plane's traffic so far: RPCs the step waited for, those sent behind it, bytes;
        and on the step channel, the seconds the step waited for the drafter's answers and the seconds
        the drafter spent in its handlers (the rest of the waiting is the channel's)."""
        lease = self.control.lease_stats
        drafter = ({"drafter_wait_s": self.channel.wait_s, "drafter_busy_s": self.channel.server_busy_s}
                   if self.channel is not None else {})
        return {"reserves_total": lease.reserves_total,
                "reserves_answered_locally": lease.reserves_answered_locally,
                "blocking_rpcs": lease.blocking_rpcs, "blocking_s": lease.blocking_s, "drains": lease.drains,
                "async_rpcs": lease.async_rpcs, **self.control.inner.traffic_totals(), **drafter}

    def close(self) -> None:
        self._attacher.shutdown(wait=False, cancel_futures=True)
        if self.async_engine is not None:
            self.async_engine.shutdown()
        if self.control is not None:
            self._drop_control()
        if self.channel is not None:
            self.channel.close()
        self.assembler.close()

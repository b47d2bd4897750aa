"""The three services as colocated Ray actors: a pool, a drafter and a target for each replica (GPU).

    services = RayServices(EngineArgs(...)).start()      # or LLM(..., services="ray")
    results = services.generate([[1, 2, 3]], [SamplingParams(max_tokens=8)])

Placement: one placement group per replica, three bundles STRICT_PACK (one node), each actor in its
own bundle and OS process, sharing the GPU through fractional GPU resources. Named actors in
namespace `dflash`: `dflash-kvpool-<i>`, `dflash-drafter-<i>`, `dflash-target-<i>`.

The settings are resolved once into an `EnginePlan` (as `build_engine` resolves them, so both refuse
the same things) before any actor starts, against the GPUs Ray will hand out: this machine's for the
embedded local Ray, the cluster's when joining one. Start-up order follows what each needs: the
drafter and the target load their weights, the target measures the KV budget (on a GPU: what both
models left), the pool is built from it, and then the target attaches to the pool and attaches the
drafter to its step buffers. Every actor restarts after a crash (max_restarts=-1) and finds its
peers by name; see `target_service.assembly.service` for what each fault costs a request. Ray
carries lifecycle, placement and health only: per step the target and the drafter meet on the
shared-memory step channel, and the target reaches the pool's block manager through gRPC
(`kvpool_service.leased_control`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from drafter_service.service import DrafterService
from foundation.device_name import cuda_device_count
from kernels.compile_watch import CompileCounts
from kvpool_service.assembler import size_pool
from kvpool_service.service import KVPoolService, PoolInfo
from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import EnginePlan, resolve_plan
from target_service.assembly.ray_runtime import NAMESPACE, start_ray
from target_service.assembly.service import GenerationResult, TargetService
from target_service.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
POOL_WAIT_S = 120.0
COMPILATIONS_WAIT_S = 5.0  # a metrics scrape waits no longer for a service's count
CLOSE_TIMEOUT_S = 30.0  # a target drains its running requests first
CPUS_PER_ACTOR = 0.25  # the actors mostly wait on each other or the GPU; CI machines have 2 cores
GPU_SHARE = 0.33  # three actors on one GPU


def service_bundle(device_type: str) -> dict[str, float]:
    """The placement-group bundle of one service actor: a share of a CPU and of the GPU."""
    return {"CPU": CPUS_PER_ACTOR} | ({"GPU": GPU_SHARE} if device_type == "cuda" else {})


class ServiceStartError(RuntimeError):
    """A service actor could not start (its constructor or start-up raised); the message is its error."""


class ServiceFailed(RuntimeError):
    """A service actor died while serving a call; its in-flight requests failed (Ray restarts it)."""


@dataclass(frozen=True)
class ServiceNames:
    replica: int

    @property
    def kvpool(self) -> str:
        return f"dflash-kvpool-{self.replica}"

    @property
    def drafter(self) -> str:
        return f"dflash-drafter-{self.replica}"

    @property
    def target(self) -> str:
        return f"dflash-target-{self.replica}"


class RayPeers:
    """`ServicePeers` over Ray: the target's view of its pool and drafter, found by actor name.
    Picklable (names only), so it travels to the target actor as a constructor argument."""

    def __init__(self, names: ServiceNames):
        self.names = names

    def _actor(self, name: str, *, wait: bool):
        import ray

        deadline = time.monotonic() + POOL_WAIT_S
        while True:
            try:
                return ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                if not wait or time.monotonic() > deadline:
                    if wait:
                        raise LookupError(f"no actor {name!r} in namespace {NAMESPACE!r}") from None
                    return None
                time.sleep(0.1)

    def pool_info(self, *, wait: bool) -> PoolInfo | None:
        import ray

        pool = self._actor(self.names.kvpool, wait=wait)
        return None if pool is None else ray.get(pool.info.remote(), timeout=POOL_WAIT_S)

    def release_pool(self) -> int:
        import ray

        return ray.get(self._actor(self.names.kvpool, wait=True).release_all.remote(), timeout=POOL_WAIT_S)

    def attach_drafter(self, pool_handle, step_handle, channel_handle):
        drafter = self._actor(self.names.drafter, wait=True)
        return drafter.attach.remote(pool_handle, step_handle, channel_handle).future()


class RayServices:
    """One replica's trio: start it (or join a Ray cluster to start it there), call it, stop it."""

    def __init__(self, args: EngineArgs, *, replica: int = 0, address: str | None = None,
                 pool_host: str = "127.0.0.1", pool_port: int = 0, pool_token: str | None = None,
                 lease_tokens: int | None = None, target_class: type = TargetService,
                 placement=None, bundles: tuple[int, int, int] = (0, 1, 2)):
        """placement: a placement group to start the three in (bundles: the pool's, the drafter's and
        the target's indices in it), owned by the caller (a Ray Serve replica's); None: make one."""
        self.args = args
        self.names = ServiceNames(replica)
        self.address = address
        self.pool_host, self.pool_port, self.pool_token = pool_host, pool_port, pool_token
        self.lease_tokens = lease_tokens
        self.target_class = target_class
        self.plan: EnginePlan | None = None  # as the actors run it; resolved by start()
        self.started_ray = False
        self.placement = placement
        self.owns_placement = placement is None
        self.bundles = bundles
        self.pool = self.drafter = self.target = None

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> RayServices:
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized() and not (self.address or os.environ.get("RAY_ADDRESS")):
            self.plan = self._resolve(cuda_device_count())  # the local Ray will hand out this machine's GPUs
        self.started_ray = start_ray(self.address)
        try:
            if self.plan is None:
                self.plan = self._resolve(self._cluster_gpus())
            if self.owns_placement:
                bundles = [service_bundle(self.device_type)] * 3
                self.placement = placement_group(bundles, strategy="STRICT_PACK",
                                                 name=f"dflash-services-{self.names.replica}")
            self._wait_for_placement(timeout_s)
            self._start_actors(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _cluster_gpus(self) -> int:
        """The GPUs the plan may count on in a running cluster: an autoscaling cluster adds GPU nodes
        only when a placement asks for them, so CUDA asked for by name is not refused for lack of one
        now (the placement's timeout says when none comes); with no device named, what is there now."""
        import ray

        gpus = int(ray.cluster_resources().get("GPU", 0))
        asked = self.args.device or ""
        return max(gpus, 1) if asked.startswith("cuda") else gpus

    def _resolve(self, cuda_devices: int) -> EnginePlan:
        return resolve_plan(self.args, cuda_devices=cuda_devices).for_ray_actors()

    @property
    def device_type(self) -> str:
        return "cuda" if self.plan.device == "cuda" else "cpu"

    def _wait_for_placement(self, timeout_s: float) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(self.placement.ready(), timeout=timeout_s)
        except GetTimeoutError:
            raise ServiceStartError(
                f"no node had room for the services of replica {self.names.replica} within {timeout_s:g} s "
                f"(three bundles of {service_bundle(self.device_type)} on one node)") from None

    def _options(self, name: str, service: int, **extra) -> dict:
        """Actor options of service 0 (pool), 1 (drafter) or 2 (target): its bundle, name, restarts."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement,
                                                    placement_group_bundle_index=self.bundles[service])
        gpus = GPU_SHARE if self.device_type == "cuda" else 0
        return dict(name=name, namespace=NAMESPACE, num_cpus=CPUS_PER_ACTOR, num_gpus=gpus,
                    max_restarts=-1, scheduling_strategy=strategy, **extra)

    def _start_actors(self, timeout_s: float) -> None:
        import ray

        plan, names = self.plan, self.names
        if plan.drafter_config is not None:
            self.drafter = ray.remote(DrafterService).options(**self._options(names.drafter, 1)).remote(
                plan.drafter_args())
            # the drafter's weights are in before the target measures what memory is left
            self._started(self.drafter.describe.remote(), "drafter", timeout_s)
        extra = {} if self.lease_tokens is None else {"lease_tokens": self.lease_tokens}
        self.target = ray.remote(self.target_class).options(**self._options(names.target, 2)).remote(
            plan, RayPeers(names),
            pool_token=self.pool_token, **extra)
        pool_args = self._started(self.target.pool_args.remote(), "target", timeout_s)
        size_pool(pool_args.spec, pool_args.budget_bytes, context_storage=pool_args.context_storage,
                  max_num_seqs=pool_args.max_num_seqs, max_model_len=pool_args.max_model_len)  # refused here
        pool_options = self._options(names.kvpool, 0, max_task_retries=-1)  # its calls are idempotent
        self.pool = ray.remote(KVPoolService).options(**pool_options).remote(
            pool_args, host=self.pool_host, port=self.pool_port, token=self.pool_token)
        self._started(self.target.start.remote(), "target", timeout_s)
        logger.info("services of replica %d up: %s", names.replica, self.pids())

    def _started(self, ref, what: str, timeout_s: float):
        """ray.get of a start-up call; an actor that could not start is one line naming its error."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise ServiceStartError(f"the {what} service of replica {self.names.replica} did not start "
                                    f"within {timeout_s:g} s") from None
        except RayError as error:
            lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
            raise ServiceStartError(f"the {what} service of replica {self.names.replica} could not start: "
                                    f"{lines[-1] if lines else type(error).__name__}") from None

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    def close(self) -> None:
        """Stop the three actors (no restart) and release their placement; stop Ray if we started it."""
        import ray

        if not ray.is_initialized():
            return
        for actor in (self.target, self.drafter, self.pool):  # each releases its files and ports first
            if actor is not None:
                try:
                    ray.get(actor.close.remote(), timeout=CLOSE_TIMEOUT_S)
                except Exception as error:  # dead, or never started: the sweep takes its files
                    logger.debug("close: %s", error)
        for actor in (self.target, self.drafter, self.pool):
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as error:  # already gone
                    logger.debug("kill: %s", error)
        self.target = self.drafter = self.pool = None
        if self.placement is not None and self.owns_placement:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
            self.placement = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    # ---- requests -----------------------------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None):
        """Start one request on the target; returns its Ray ObjectRef (ray.cancel aborts it)."""
        return self.target.generate.remote(list(prompt_token_ids), params, request_id)

    def start_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        """Start one request whose deltas come through `delta_batches` (its errors too: not waited for)."""
        self.target.start_request.remote(list(prompt_token_ids), params, request_id)

    def abort(self, request_id: str) -> None:
        """Abort a started request (not waited for): its pages are freed before the target's next step."""
        if self.target is not None:  # after close there is nothing left to abort
            self.target.abort.remote(request_id)

    async def delta_batches(self):
        """The target's batches of every started request's deltas, for as long as it lives (one Ray
        streaming call; a dead target raises RayActorError here)."""
        async for ref in self.target.deltas.options(num_returns="streaming").remote():
            yield await ref

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The target's refusal (ValueError) of a request that could never run; None when it can."""
        self._ask(self.target.check, list(prompt_token_ids), params)

    def snapshot(self) -> dict:
        return self._ask(self.target.snapshot)

    def counters(self):
        """The target engine's `EngineCounters`."""
        return self._ask(self.target.counters)

    def generate(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
                 ) -> list[GenerationResult]:
        for ids, p in zip(prompts, params):  # refuse the whole call before anything runs
            self.check(ids, p)
        return self._get([self.submit(ids, p) for ids, p in zip(prompts, params)])

    def _ask(self, method, *args):
        """A call that changes nothing, retried while the target is restarting (up to its start-up)."""
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                return self._get(method.remote(*args))
            except ServiceFailed as error:
                if not isinstance(error.__cause__, ActorUnavailableError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _get(self, refs, timeout: float | None = None):
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return ray.get(refs, timeout=timeout)
        except (RayActorError, ActorDiedError, ActorUnavailableError) as error:
            count = len(refs) if isinstance(refs, list) else 1
            raise ServiceFailed(f"the target service of replica {self.names.replica} died while serving "
                                f"{count} requests; they failed and Ray is restarting it: retry them"
                                ) from error
        except ray.exceptions.RayTaskError as error:  # the request itself was refused: its own error,
            cause = getattr(error, "cause", None)  # as raised there (Ray's wrapper's text is its traceback)
            raise (cause if isinstance(cause, Exception) else error.as_instanceof_cause()) from None

    # ---- observing ----------------------------------------------------------------------------------

    def stats(self):
        return self._ask(self.target.stats)

    def describe(self) -> dict:
        return self._ask(self.target.describe)

    def pool_info(self) -> PoolInfo:
        import ray

        return ray.get(self.pool.info.remote(), timeout=POOL_WAIT_S)

    def pool_stats(self):
        import ray

        return ray.get(self.pool.stats.remote(), timeout=POOL_WAIT_S)

    def compilations(self) -> dict[str, CompileCounts]:
        """Each service's own count of the Triton kernels its process built (a service that does not
        answer in time, restarting, is left out of this reading)."""
        import ray

        services = {"kvpool": self.pool, "drafter": self.drafter, "target": self.target}
        asked = {name: actor.compilations.remote() for name, actor in services.items() if actor is not None}
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=COMPILATIONS_WAIT_S)
        counts = {}
        for name, ref in asked.items():
            try:
                if ref in answered:
                    counts[name] = ray.get(ref)
            except Exception as error:  # died while answering: its count comes back with it
                logger.debug("compilations of the %s service: %s", name, error)
        return counts

    def pids(self) -> dict[str, int]:
        import ray

        pids = {"kvpool": self.pool_info().pid, "target": self.describe()["pid"]}
        if self.drafter is not None:
            pids["drafter"] = ray.get(self.drafter.describe.remote(), timeout=POOL_WAIT_S)["pid"]
        return pids

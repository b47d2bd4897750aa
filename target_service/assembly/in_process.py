"""The in-process engine: the three services' assemblers run in one process and meet as they would
across processes, through a `PoolHandle`, `PoolControl`, the step buffers' handle and `DraftControl`.

This is the engine behind the offline `LLM` API and most tests, and the baseline that measures what
the service split costs. Its memory is private (share=False: no /dev/shm file); the handles it
passes are in-process ones, which refuse to be pickled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from drafter_service.assembler import DrafterAssembler
from kvpool_service.assembler import KVPool, build_pool
from kvpool_service.control import PoolControl
from target_service.assembly.assembler import TargetAssembler
from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import EnginePlan, resolve_plan
from target_service.engine.engine import LLMEngine
from target_service.runner.model_runner import ModelRunner


@dataclass
class InProcessEngine:
    """The engine and what it was assembled from; `close()` releases the pool and the buffers."""

    engine: LLMEngine
    runner: ModelRunner
    plan: EnginePlan
    tokenizer: object  # tokenizers.Tokenizer, or None for a checkpoint without tokenizer.json
    pool: KVPool
    drafter: DrafterAssembler | None = None
    _closers: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for closer in self._closers:
            closer()
        self.pool.close()


def build_engine(args: EngineArgs, *,
                 control: Callable[[KVPool], PoolControl] | None = None) -> InProcessEngine:
    """The three services assembled here, in their start-up order.

    control: the `PoolControl` the engine reaches the pool through, made from the pool (default: its
    own block manager; the tests put a gRPC client to a server over it in between).
    """
    plan = resolve_plan(args)
    target = TargetAssembler(plan)
    drafter = DrafterAssembler(plan.drafter_args()).load() if args.drafter is not None else None
    target.load()  # both models' weights are in memory before a GPU budget is measured
    pool = build_pool(plan.pool_args(target.kv_budget(), share=False))
    buffers = target.create_step_buffers(share=False)
    worker = drafter.build(pool.handle, buffers.export()) if drafter is not None else None
    engine = target.build(pool.control if control is None else control(pool), pool.handle, worker)
    closers = [target.close] + ([drafter.close] if drafter is not None else [])
    return InProcessEngine(engine, target.runner, plan, target.checkpoint.tokenizer, pool, drafter, closers)

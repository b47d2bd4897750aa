"""The in-process engine: the three services' assemblers run in one process and meet as they would
across processes, through a `PoolHandle`, `PoolControl`, the step buffers' handle and `DraftControl`.

This is the engine behind the offline `LLM` API and most tests, and the baseline that measures what
the service split costs. Its memory is private (share=False: no /dev/shm file); the handles it
passes are in-process ones, which refuse to be pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter_service.assembler import DrafterArgs, DrafterAssembler
from kvpool_service.assembler import KVPool, PoolArgs, build_pool
from target_service.assembly.assembler import TargetAssembler
from target_service.assembly.engine_args import EngineArgs
from target_service.engine.engine import LLMEngine


@dataclass
class InProcessEngine:
    """The engine and what it was assembled from; `close()` releases the pool and the buffers."""

    engine: LLMEngine
    tokenizer: object  # tokenizers.Tokenizer, or None for a checkpoint without tokenizer.json
    pool: KVPool
    _closers: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        for closer in self._closers:
            closer()
        self.pool.close()


def build_engine(args: EngineArgs) -> InProcessEngine:
    target = TargetAssembler(args)
    drafter = None
    if args.drafter is not None:
        drafter = DrafterAssembler(DrafterArgs(
            drafter=args.drafter, target=args.target, dtype=target.dtype, device=str(target.device),
            context_storage=args.context_storage, max_num_seqs=args.max_num_seqs,
            max_model_len=target.max_model_len, enforce_eager=args.enforce_eager,
            cuda_graph_sizes=args.cuda_graph_sizes)).load()
    target.load()  # both models' weights are in memory before a GPU budget is measured
    pool = build_pool(PoolArgs(
        spec=target.pool_spec(), budget_bytes=target.kv_budget(), context_storage=args.context_storage,
        max_num_seqs=args.max_num_seqs, max_model_len=target.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, device=str(target.device), share=False))
    buffers = target.create_step_buffers(share=False)
    worker = drafter.build(pool.handle, buffers.export()) if drafter is not None else None
    engine = target.build(pool.control, pool.handle, worker)
    closers = [target.close] + ([drafter.close] if drafter is not None else [])
    return InProcessEngine(engine, target.checkpoint.tokenizer, pool, closers)

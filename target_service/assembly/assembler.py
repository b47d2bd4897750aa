"""The target service's assembler: the target model, its step buffers, the runner and the engine,
built from an `EnginePlan` against the pool's `PoolControl` + `PoolHandle` and the drafter's
`DraftControl` only.

What only the target can know it measures here: the KV budget (on a GPU, what is left after the
weights and a profiling forward). The pool service sizes the pool from that budget; the drafter
service maps the step buffers this assembler creates.
"""

from __future__ import annotations

import logging

import torch

from drafter_service.control import DraftControl
from drafter_service.step_buffers import StepBuffers
from foundation.cuda_graph_sizes import capture_sizes
from foundation.environment import env_switch
from kernels import paged_warmup
from kernels.compile_watch import WATCH
from kvpool_service.control import PoolControl
from kvpool_service.geometry import PoolSpec
from kvpool_service.memory import PoolHandle, PoolMemory
from target_service.assembly.plan import EnginePlan
from target_service.engine.adaptive_speculation import AdaptiveSpeculation
from target_service.engine.engine import LLMEngine
from target_service.engine.scheduler import Scheduler
from target_service.engine.stop_checker import StopChecker
from target_service.proposers.choose import make_proposer
from target_service.runner.checkpoint import load_target, open_target_checkpoint
from target_service.runner.cuda_graphs import GraphKey, TargetGraphs
from target_service.runner.memory_budget import device_kv_budget
from target_service.runner.model_runner import ModelRunner
from target_service.runner.warm_up import warm_up_forwards
from target_service.structured.vocabulary import GrammarVocabulary

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_MEMORY = 256 * 2**20


class TargetAssembler:
    """`load()` the weights, then `kv_budget()`, `create_step_buffers()` and `build(...)`."""

    def __init__(self, plan: EnginePlan):
        self.plan = plan
        self.device = torch.device(plan.device)
        WATCH.install()  # counts what compiles from here on, and after ready (`build`)
        self.checkpoint = open_target_checkpoint(plan.args.target)
        self.model = None
        self.memory: PoolMemory | None = None
        self.buffers: StepBuffers | None = None
        self.runner: ModelRunner | None = None

    def load(self) -> TargetAssembler:
        plan = self.plan
        self.model, _ = load_target(self.checkpoint, tap_layer_ids=plan.tap_layer_ids, dtype=plan.dtype,
                                    device=self.device)
        return self

    def kv_budget(self) -> int:
        """kv_cache_memory when given; on a GPU what the weights and activations leave; else a default."""
        plan = self.plan
        if plan.kv_cache_bytes is not None:
            return plan.kv_cache_bytes
        if self.device.type == "cuda":
            return device_kv_budget(self._model(), self.device, plan.args.gpu_memory_utilization,
                                    plan.args.max_num_batched_tokens)
        return CPU_DEFAULT_KV_MEMORY

    def create_step_buffers(self, *, share: bool) -> StepBuffers | None:
        """The buffers the drafter maps (None without a drafter); share=True to hand them out of process."""
        layout = self.plan.step_buffer_layout()
        if layout is None:
            return None
        self.buffers = StepBuffers.create(layout, self.device, share=share)
        return self.buffers

    def build(self, pool: PoolControl, pool_handle: PoolHandle, drafter: DraftControl | None, *,
              on_pool_lost=None) -> LLMEngine:
        """The engine over the pool's target layers (mapped from the handle) and the drafter's calls;
        on_pool_lost: see `LLMEngine`."""
        plan = self.plan
        if (drafter is None) != (plan.drafter_config is None):
            raise ValueError("a drafter was configured but none was given, or the reverse")
        if plan.block_size is not None and self.buffers is None:
            raise RuntimeError("create_step_buffers() comes before build() when there is a proposer")
        if drafter is not None and drafter.block_size != plan.block_size:
            raise ValueError(f"the drafter's block_size {drafter.block_size} differs from its config's "
                             f"{plan.block_size}")
        proposer = make_proposer(plan, drafter, self.buffers)
        caches, layout = self._attach(pool_handle)
        limits = pool.limits()
        self._warm_up_attention(caches)
        self._warm_up_forwards(caches, limits)
        self.runner = ModelRunner(self._model(), caches, tokens_per_block=limits.tokens_per_block,
                                  draft_budget=plan.draft_budget(), drafter=proposer,
                                  step_buffers=self.buffers, graphs=self._graphs(caches, layout),
                                  seed=plan.args.seed)
        speculation = (AdaptiveSpeculation(plan.num_speculative_tokens, plan.speculation_choices)
                       if plan.adaptive_speculation else None)
        scheduler = Scheduler(pool, max_num_seqs=plan.args.max_num_seqs,
                              max_num_batched_tokens=plan.args.max_num_batched_tokens,
                              draft_budget=plan.draft_budget(),
                              max_prefill_tokens_with_decodes=plan.args.max_prefill_tokens_with_decodes,
                              speculation=speculation, before_release=self.runner.before_release)
        stop_checker = StopChecker(self.checkpoint.eos_token_ids, self.checkpoint.tokenizer)
        tokenizer = self.checkpoint.tokenizer
        grammars = (GrammarVocabulary(tokenizer, self.checkpoint.eos_token_ids, self.runner.vocab_size)
                    if tokenizer is not None else None)
        engine = LLMEngine(self.runner, scheduler, limits=limits, stop_checker=stop_checker,
                           async_scheduling=plan.async_scheduling, on_pool_lost=on_pool_lost,
                           grammars=grammars)
        WATCH.mark_ready()
        return engine

    def rebind(self, engine: LLMEngine, pool: PoolControl, pool_handle: PoolHandle) -> list:
        """Move `engine` and its runner onto a restarted pool: map its pages, capture graphs over them,
        and requeue every running sequence for recompute (the new pool is empty). Returns the requeued."""
        previous = self.memory
        self.runner.drop_graphs()  # the old graphs hold the old pages; free them before capturing new ones
        caches, layout = self._attach(pool_handle)
        self.runner.rebind(caches, self._graphs(caches, layout))
        requeued = engine.rebind_pool(pool, pool.limits())
        if previous is not None:
            previous.close()
        return requeued

    def _attach(self, pool_handle: PoolHandle):
        """The pool's target layers, mapped from the handle (refused unless the layout is ours)."""
        layout = pool_handle.layout
        own = PoolSpec.from_configs(self.checkpoint.config, tokens_per_block=layout.spec.tokens_per_block,
                                    dtype=self.plan.target_cache_dtype).target
        expected = layout.model_copy(update={"spec": layout.spec.model_copy(update={"target": own})})
        self.memory = PoolMemory.attach(pool_handle, expected)
        return self.memory.layers("target"), layout

    def _warm_up_attention(self, caches) -> None:
        """Every variant of the paged attention kernel a step can launch, compiled now rather than
        in the step loop (`kernels.paged_warmup`); the graphs capture what the steady state runs."""
        if self.device.type != "cuda":
            return
        config, args = self.checkpoint.config, self.plan.args
        cache = caches[0]  # every layer's pages share one dtype and shape
        paged_warmup.warm_up(cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale,
                             num_heads=config.num_attention_heads, q_dtype=self._model().embed_tokens.dtype,
                             max_tokens=args.max_num_batched_tokens, max_seqs=args.max_num_seqs)

    def _warm_up_forwards(self, caches, limits) -> None:
        """The first uses a mixed step's eager forward meets outside Triton, made now, over the pool's
        first pages (`runner.warm_up`; nothing holds them yet). DFLASH_WARM_UP=0 skips it (to measure
        what it saves)."""
        if self.device.type != "cuda" or not env_switch("DFLASH_WARM_UP"):
            return
        args, per_seq = self.plan.args, max(self.plan.speculation_choices) + 1
        pool_rows = limits.num_blocks * limits.tokens_per_block
        warm_up_forwards(self._model(), caches, tokens_per_block=limits.tokens_per_block,
                         max_rows=min(args.max_num_batched_tokens, pool_rows),
                         max_logits=args.max_num_seqs * per_seq)

    def _graphs(self, caches, layout) -> TargetGraphs | None:
        """CUDA graphs of the steady-state steps: verify k + 1 rows with taps for every k a step may
        verify (K; each adaptive choice), and a 1-row decode."""
        plan = self.plan
        if self.device.type != "cuda" or plan.args.enforce_eager:
            return None
        taps = plan.drafter_config is not None  # only the DFlash drafter reads the target's hidden states
        rows = sorted({1, *(k + 1 for k in plan.speculation_choices)}, reverse=True)
        keys = [GraphKey(q_len, taps) for q_len in rows]  # the largest first, as before
        sizes = capture_sizes(plan.args.max_num_seqs, plan.args.cuda_graph_sizes)
        max_blocks = -(-plan.max_model_len // layout.spec.tokens_per_block)
        return TargetGraphs(self._model(), caches, sizes=sizes, keys=keys, max_blocks_per_seq=max_blocks,
                            device=self.device).capture()

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
        if self.buffers is not None:
            self.buffers.close()

    def _model(self):
        if self.model is None:
            raise RuntimeError("load() the target first")
        return self.model

"""EnginePlan: the user's `EngineArgs` resolved once against the machine and the checkpoints' configs.

Every setting that follows from the arguments is decided here and nowhere else: the device, the
compute and cache dtypes, max_model_len (checked against the target's), K (checked against the
drafter's block), the taps, and what the drafter, the pool and the step buffers are built from.
Both assemblies carry out the same plan (`in_process.build_engine`, and `ray_services.RayServices`,
which ships it to its actors), so each refuses exactly what the other does, before any weight is
read. Only configs are read (no weights, no tokenizer), so resolving is quick and can happen in a
process that will never load the model (a Ray driver).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from drafter_service.assembler import DrafterArgs
from drafter_service.step_buffers import StepBufferLayout
from foundation.byte_size import parse_byte_size
from foundation.checkpoint_config import (
    DrafterConfig,
    TargetConfig,
    check_drafter_fits,
    load_drafter_config,
    load_target_config,
)
from foundation.device_name import cuda_device_count, resolve_device_name
from foundation.validation_error import InvalidSetting
from foundation.weights import resolve_dtype
from kvpool_service.assembler import PoolArgs
from kvpool_service.geometry import DTYPE_NAMES, PoolSpec
from target_service.assembly.engine_args import EngineArgs
from target_service.engine.adaptive_speculation import default_choices
from target_service.engine.draft_budget import DraftBudget

TOKEN_METHODS = ("ngram", "hybrid")  # the methods whose proposals read the host's tokens
NGRAM_DEFAULT_K = 7  # prompt lookup's drafts per step when not given (a drafter's block sets its own)


class EnginePlan(BaseModel):
    """What one engine is built from; read its fields, never the raw args, where they differ."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    args: EngineArgs
    device: str  # as the process that builds the engine names it: cpu, cuda or cuda:N
    dtype: str | None  # the compute dtype asked for; None: the checkpoints' own
    kv_dtype: str  # the compute dtype by name: the taps', the draft context's (e.g. "bfloat16")
    target_cache_dtype: str  # the target's K/V pages: kv_dtype, or float8 e4m3 (kv_cache_dtype "fp8")
    max_model_len: int
    num_speculative_tokens: int  # K; 0 without speculation
    speculative_method: str | None  # "dflash", "ngram" or "hybrid"; None: plain decoding
    adaptive_speculation: bool = False  # each step verifies the best k of 0..K (AdaptiveSpeculation)
    target_config: TargetConfig
    drafter_config: DrafterConfig | None

    @property
    def block_size(self) -> int | None:
        """The proposer's block (a step verifies at most block_size - 1 drafts); None: no proposer."""
        if self.drafter_config is not None:
            return self.drafter_config.block_size
        return self.num_speculative_tokens + 1 if self.speculative_method == "ngram" else None

    @property
    def async_scheduling(self) -> bool:
        """Prompt lookup reads the tokens on the host, which a step launched ahead has not delivered."""
        return self.args.async_scheduling and self.speculative_method not in TOKEN_METHODS

    @property
    def tap_layer_ids(self) -> list[int]:
        return list(self.drafter_config.target_layer_ids) if self.drafter_config is not None else []

    @property
    def kv_cache_bytes(self) -> int | None:
        """kv_cache_memory in bytes; None: measured on a GPU, a default on a CPU."""
        memory = self.args.kv_cache_memory
        return None if memory is None else parse_byte_size(memory)

    @property
    def speculation_choices(self) -> tuple[int, ...]:
        """The drafts a decode step may verify: the adaptive choices of 0..K, or K alone."""
        if self.adaptive_speculation:
            return default_choices(self.num_speculative_tokens)
        return (self.num_speculative_tokens,)

    def draft_budget(self) -> DraftBudget:
        return DraftBudget(self.num_speculative_tokens, self.max_model_len)

    def pool_spec(self) -> PoolSpec:
        """Every group the pool needs for this pair (the pool drops the draft group for dense context)."""
        return PoolSpec.from_configs(self.target_config, self.drafter_config,
                                     tokens_per_block=self.args.tokens_per_block,
                                     dtype=self.target_cache_dtype, context_dtype=self.kv_dtype)

    def pool_args(self, budget_bytes: int, *, share: bool) -> PoolArgs:
        """The pool's settings, given the KV budget the target measured."""
        args = self.args
        return PoolArgs(spec=self.pool_spec(), budget_bytes=budget_bytes,
                        context_storage=args.context_storage, max_num_seqs=args.max_num_seqs,
                        max_model_len=self.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching, device=self.device, share=share)

    def drafter_args(self) -> DrafterArgs | None:
        args = self.args
        if args.drafter is None:
            return None
        return DrafterArgs(drafter=args.drafter, target=args.target, dtype=self.dtype, device=self.device,
                           context_storage=args.context_storage, max_num_seqs=args.max_num_seqs,
                           max_model_len=self.max_model_len, enforce_eager=args.enforce_eager,
                           cuda_graph_sizes=args.cuda_graph_sizes)

    def step_buffer_layout(self) -> StepBufferLayout | None:
        """The buffers the target fills and the drafter maps (None without a proposer). Prompt lookup
        alone stores no context: its context side is one row wide."""
        if self.block_size is None:
            return None
        args = self.args
        stores_context = self.drafter_config is not None
        return StepBufferLayout(
            max_num_seqs=args.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // args.tokens_per_block),
            max_num_draft=self.block_size - 1,
            max_context_rows=args.max_num_batched_tokens if stores_context else 1,
            tap_width=len(self.tap_layer_ids) * self.target_config.hidden_size if stores_context else 1,
            tap_dtype=self.kv_dtype)

    def for_ray_actors(self) -> EnginePlan:
        """This plan as each service actor runs it: Ray gives every actor its GPU, which it sees as
        cuda:0, so a device index other than 0 cannot be honoured and is refused."""
        if self.device.startswith("cuda:") and self.device != "cuda:0":
            raise ValueError(f"device {self.device!r}: with services='ray' Ray gives each service its GPU; "
                             "give device 'cuda' (or none)")
        return self.model_copy(update={"device": "cuda" if self.device.startswith("cuda") else "cpu"})


def resolve_plan(args: EngineArgs, *, cuda_devices: int | None = None) -> EnginePlan:
    """`args` resolved against `cuda_devices` CUDA devices (None: this process's) and the configs.

    Every refusal is one line naming what is wrong: a device the machine lacks, max_model_len past
    the target's positions, K past the drafter's block, a drafter that does not fit the target.
    """
    device = resolve_device_name(args.device, cuda_device_count() if cuda_devices is None else cuda_devices)
    target = load_target_config(args.target)
    method = speculative_method(args)
    drafter = load_drafter_config(args.drafter) if args.drafter is not None else None
    if drafter is not None:
        check_drafter_fits(target, drafter)
    if args.max_model_len is not None and args.max_model_len > target.max_position_embeddings:
        raise ValueError(f"max_model_len {args.max_model_len} exceeds the target's "
                         f"max_position_embeddings {target.max_position_embeddings}")
    dtype = compute_dtype(args.dtype, device)
    kv_dtype = str(resolve_dtype(dtype, target.dtype_name)).removeprefix("torch.")
    plan = EnginePlan(
        args=args, device=device, dtype=dtype, kv_dtype=kv_dtype,
        target_cache_dtype=DTYPE_NAMES["fp8"] if args.kv_cache_dtype == "fp8" else kv_dtype,
        max_model_len=args.max_model_len or target.max_position_embeddings,
        num_speculative_tokens=num_speculative_tokens(args.num_speculative_tokens, method,
                                                      drafter.block_size if drafter is not None else None),
        speculative_method=method, adaptive_speculation=adaptive_speculation(args, method, device),
        target_config=target, drafter_config=drafter)
    try:
        plan.pool_spec()  # the pool's geometry refuses what it cannot page (a tokens_per_block, a dtype)
    except ValidationError as error:
        raise InvalidSetting(error) from None
    return plan


def compute_dtype(asked: str | None, device: str) -> str | None:
    """The dtype asked for; with none, float32 on CPU and the checkpoint's own dtype (None) elsewhere.

    CPUs have no fast 16-bit matrix units to gain from, and 16-bit weights are exact in float32,
    so a CPU engine computes in float32 by default: greedy decoding with a drafter is then lossless
    bit for bit (bf16 verify blocks and 1-token decodes round near-ties differently).
    """
    if asked is not None:
        return asked
    return "float32" if device == "cpu" else None


def speculative_method(args: EngineArgs) -> str | None:
    """Who drafts: the method asked for, checked against the drafter given; by default the drafter,
    or nobody without one."""
    method = args.speculative_method
    if args.prompt_lookup_min > args.prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min {args.prompt_lookup_min} exceeds prompt_lookup_max "
                         f"{args.prompt_lookup_max}")
    if method is None:
        return "dflash" if args.drafter is not None else None
    if method == "ngram" and args.drafter is not None:
        raise ValueError("speculative_method 'ngram' drafts by prompt lookup and takes no drafter; "
                         "give 'hybrid' to use both")
    if method in ("dflash", "hybrid") and args.drafter is None:
        raise ValueError(f"speculative_method {method!r} needs a drafter")
    return method


def adaptive_speculation(args: EngineArgs, method: str | None, device: str) -> bool:
    """Whether each step chooses how many drafts it verifies. As asked; by default, on for DFlash on
    a GPU unless K is pinned (`num_speculative_tokens` given): on the H200 it ran at 0.96-1.05 of
    the better of fixed K 15 and K 7 in every case measured (bench/results/adaptive_h200.md), where
    K 7 runs at 0.74 of K 15 at batch 1 and K 15 at 0.91 of K 7 at batch 32. Off on a CPU, where
    it was never measured against a fixed K. Prompt lookup and the hybrid choose their drafts their
    own way."""
    if args.adaptive_speculation and method != "dflash":
        raise ValueError(f"adaptive_speculation needs speculative_method 'dflash' (this engine's is "
                         f"{method!r})")
    if args.adaptive_speculation is None:
        return method == "dflash" and device.startswith("cuda") and args.num_speculative_tokens is None
    return args.adaptive_speculation


def num_speculative_tokens(asked: int | None, method: str | None, block_size: int | None) -> int:
    """K: for a drafter of `block_size` at most block_size - 1, that by default; for prompt lookup
    alone `NGRAM_DEFAULT_K` by default; 0 for plain decoding."""
    if method == "ngram":
        return asked or NGRAM_DEFAULT_K
    if block_size is None:
        if asked:
            raise ValueError("num_speculative_tokens needs a drafter or speculative_method 'ngram'")
        return 0
    limit = block_size - 1
    value = asked or limit
    if value > limit:
        raise ValueError(f"num_speculative_tokens {value} exceeds the drafter's block_size - 1 = {limit}")
    return value

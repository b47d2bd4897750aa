"""Pool geometry and budget: layer groups, bytes per token, blocks for a memory budget.

A block id covers `tokens_per_block` consecutive positions of one sequence in every layer of every
group, so one per-token price (target + draft bytes) makes admission exact. Each group is counted
from its OWN shape: mis-counting the draft (wrong layer or head count) is the classic bug here.
"""

from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from foundation.checkpoint_config import DrafterConfig, TargetConfig, check_drafter_fits

DTYPE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
SCALE_BYTES = 4  # one fp32 scale for K and one for V per layer of an fp8 group


def _check_power_of_two(name: str, value: int) -> int:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return value


class LayerGroup(BaseModel):
    """Layers that share one K/V geometry and dtype: the target's, or the drafter's context."""

    model_config = ConfigDict(frozen=True)

    name: Literal["target", "draft"]
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]

    @field_validator("head_dim")
    @classmethod
    def _head_dim_power_of_two(cls, value: int) -> int:
        return _check_power_of_two("head_dim", value)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer of the group for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def scale_bytes(self) -> int:
        """Fixed bytes of the per-layer K and V scales of an fp8 group (0 otherwise)."""
        return 2 * self.num_layers * SCALE_BYTES if self.is_fp8 else 0


class PoolSpec(BaseModel):
    """The groups of one pool and its page size; everything else is derived from these."""

    model_config = ConfigDict(frozen=True)

    target: LayerGroup
    draft: LayerGroup | None = None
    tokens_per_block: int = 32

    @field_validator("tokens_per_block")
    @classmethod
    def _tokens_per_block_power_of_two(cls, value: int) -> int:
        return _check_power_of_two("tokens_per_block", value)

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)

    @property
    def bytes_per_token(self) -> int:
        return sum(group.bytes_per_token for group in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.tokens_per_block * self.bytes_per_token

    @property
    def fixed_bytes(self) -> int:
        """Bytes that do not scale with blocks (fp8 scales)."""
        return sum(group.scale_bytes for group in self.groups)

    def num_blocks(self, memory_bytes: int) -> int:
        """Blocks that fit in `memory_bytes` (every group's pages plus the fixed bytes)."""
        return max(0, (memory_bytes - self.fixed_bytes) // self.bytes_per_block)

    def without_draft(self) -> PoolSpec:
        return self.model_copy(update={"draft": None})

    @classmethod
    def from_configs(
        cls,
        target: TargetConfig,
        drafter: DrafterConfig | None = None,
        *,
        tokens_per_block: int = 32,
        dtype: str | None = None,
        context_dtype: str | None = None,
    ) -> PoolSpec:
        """Groups of a target (and drafter) checkpoint: the target's pages in `dtype`, the draft
        context in `context_dtype`; each defaults to the one before it (`dtype` to the target's weights).

        Both may be a short name (bf16, fp16, fp32, fp8) or a torch dtype name.
        """
        kv_dtype = DTYPE_NAMES.get(dtype, dtype) if dtype else target.dtype_name
        target_group = LayerGroup(
            name="target", num_layers=target.num_hidden_layers, num_kv_heads=target.num_key_value_heads,
            head_dim=target.head_dim, dtype=kv_dtype,
        )
        draft_group = None
        if drafter is not None:
            check_drafter_fits(target, drafter)
            draft_group = LayerGroup(
                name="draft", num_layers=drafter.num_hidden_layers,
                num_kv_heads=drafter.num_key_value_heads, head_dim=drafter.head_dim,
                dtype=DTYPE_NAMES.get(context_dtype, context_dtype) if context_dtype else kv_dtype,
            )
        return cls(target=target_group, draft=draft_group, tokens_per_block=tokens_per_block)


def dense_context_bytes(spec: PoolSpec, *, max_num_seqs: int, max_model_len: int) -> int:
    """Bytes of the dense baseline's draft context: every sequence index holds max_model_len positions, padded
    to whole pages (`drafter_service.context_storage.DenseContext` allocates exactly this)."""
    if spec.draft is None:
        return 0
    padded = -(-max_model_len // spec.tokens_per_block) * spec.tokens_per_block
    return max_num_seqs * padded * spec.draft.bytes_per_token


class StoragePlan(BaseModel):
    """What one context storage (paged or dense) does with the budget."""

    draft_context_bytes: int = Field(description="bytes the draft context takes (dense: up front)")
    target_pool_bytes: int
    num_blocks: int
    max_tokens: int
    concurrent_requests: int = Field(description="requests of avg_seq_len tokens that run at once: what "
                                                 "the blocks hold, at most max_num_seqs")
    uncapped_requests: int = Field(description="requests of avg_seq_len tokens the blocks hold, before the "
                                               "max_num_seqs cap")


class PoolPlan(BaseModel):
    """`dflash plan`: the budget of one pool, paged next to the dense baseline."""

    target_bytes_per_token: int
    draft_bytes_per_token: int
    total_bytes_per_token: int
    tokens_per_block: int
    num_blocks: int
    max_tokens: int
    memory_bytes: int
    max_model_len: int
    max_num_seqs: int
    avg_seq_len: int
    paged: StoragePlan
    dense: StoragePlan


def _storage(draft_context_bytes: int, target_pool_bytes: int, num_blocks: int, tokens_per_block: int,
             blocks_per_request: int, max_num_seqs: int) -> StoragePlan:
    held = num_blocks // blocks_per_request
    return StoragePlan(draft_context_bytes=draft_context_bytes, target_pool_bytes=target_pool_bytes,
                       num_blocks=num_blocks, max_tokens=num_blocks * tokens_per_block,
                       concurrent_requests=min(max_num_seqs, held), uncapped_requests=held)


def plan_pool(spec: PoolSpec, memory_bytes: int, *, max_model_len: int, max_num_seqs: int,
              avg_seq_len: int | None = None) -> PoolPlan:
    """Blocks and concurrency of `spec` in `memory_bytes`, paged context next to dense context.

    Dense reserves max_num_seqs x max_model_len draft tokens up front and leaves the target pool the
    rest; paged prices every live token at target + draft bytes. A request of avg_seq_len tokens
    holds ceil(avg_seq_len / tokens_per_block) blocks, and no more than max_num_seqs requests run at
    once whatever the blocks hold, with either storage.
    """
    for name, value in (("memory", memory_bytes), ("max_model_len", max_model_len),
                        ("max_num_seqs", max_num_seqs), ("avg_seq_len", avg_seq_len)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    avg_seq_len = avg_seq_len or max_model_len
    tpb = spec.tokens_per_block
    blocks_per_request = -(-avg_seq_len // tpb)
    draft_bpt = spec.draft.bytes_per_token if spec.draft else 0

    num_blocks = spec.num_blocks(memory_bytes)
    paged = _storage(num_blocks * tpb * draft_bpt + (spec.draft.scale_bytes if spec.draft else 0),
                     num_blocks * tpb * spec.target.bytes_per_token, num_blocks, tpb, blocks_per_request,
                     max_num_seqs)
    reservation = dense_context_bytes(spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    target_only = spec.without_draft()
    dense_blocks = target_only.num_blocks(memory_bytes - reservation)
    dense = _storage(reservation, dense_blocks * target_only.bytes_per_block, dense_blocks, tpb,
                     blocks_per_request, max_num_seqs)
    return PoolPlan(
        target_bytes_per_token=spec.target.bytes_per_token, draft_bytes_per_token=draft_bpt,
        total_bytes_per_token=spec.bytes_per_token, tokens_per_block=tpb, num_blocks=num_blocks,
        max_tokens=num_blocks * tpb, memory_bytes=memory_bytes, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, avg_seq_len=avg_seq_len, paged=paged, dense=dense,
    )


class PoolLayout(BaseModel):
    """The layout of one live pool: what an attaching process or a remote client must agree on.

    `epoch` is drawn fresh each time a pool is created, so a client or an attached view of a
    restarted pool is detected (and refused) instead of reading someone else's pages.
    """

    model_config = ConfigDict(frozen=True)

    spec: PoolSpec
    num_blocks: PositiveInt
    epoch: int = Field(ge=1)

    @classmethod
    def create(cls, spec: PoolSpec, num_blocks: int) -> PoolLayout:
        return cls(spec=spec, num_blocks=num_blocks, epoch=secrets.randbits(62) + 1)

"""The flags of the two `dflash train` commands as validated models: `TrainRunArgs` (what every run
shares: where it writes, the schedule's length, saving, resuming and the device), extended by
`TrainTargetArgs` and `TrainDrafterArgs`.

They live apart from the training code and import nothing heavy: the CLI builds its parser from
their fields, and `dflash --help` must not wait for torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from foundation.byte_size import parse_byte_size
from foundation.device_name import check_device_name


class TrainRunArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    out: str
    corpus: list[str] | None = None
    held_out_percent: float = Field(5.0, gt=0, lt=100)
    seq_len: int = Field(512, ge=8)
    batch_size: int = Field(32, ge=1)
    steps: int = Field(2000, ge=1)
    warmup_steps: int = Field(100, ge=0)
    save_every: int = Field(500, ge=1)
    save_dtype: str = Field("bfloat16", pattern="^(bfloat16|float16|float32)$")
    max_shard_size: str = "4MiB"  # package files stay under 5 MB each
    seed: int = 0
    device: str | None = None
    time_budget: float | None = Field(None, gt=0)
    stop_after: int | None = Field(None, ge=1)
    resume: bool = False

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str) -> str:
        parse_byte_size(value)  # a field validator, so the error names the field (the CLI: its flag)
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        return value if value is None else check_device_name(value)

    @model_validator(mode="after")
    def _check_run(self):
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")
        return self


class TrainTargetArgs(TrainRunArgs):
    """Every `dflash train target` flag, validated once (field names are the flags')."""

    tokenizer: str | None = None
    vocab_size: int = Field(4096, ge=300)
    tokenizer_sample_mb: float = Field(8.0, gt=0)
    layers: int = Field(6, ge=1)
    hidden: int = Field(256, ge=16)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    head_dim: int = Field(64, ge=16)
    intermediate: int = Field(768, ge=1)
    max_position_embeddings: int = Field(4096, ge=16)
    steps: int = Field(3000, ge=1)
    warmup_steps: int = Field(200, ge=0)
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    eval_batches: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim must be a power of two, got {self.head_dim}")
        if self.seq_len >= self.max_position_embeddings:
            raise ValueError(f"seq_len ({self.seq_len}) must be below max_position_embeddings "
                             f"({self.max_position_embeddings})")
        return self


class TrainDrafterArgs(TrainRunArgs):
    """Every `dflash train drafter` flag, validated once (field names are the flags')."""

    target: str
    block_size: int = Field(16, ge=2)
    layers: int = Field(2, ge=1)
    taps: str = "auto"
    intermediate: int | None = Field(None, ge=1)
    mask_token_id: int | None = Field(None, ge=0)
    gamma: float | None = Field(None, gt=0)
    anchors: int = Field(32, ge=1)
    steps: int = Field(2000, ge=1)
    warmup_steps: int = Field(100, ge=0)
    lr: float = Field(1.5e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    generated: int = Field(2048, ge=0)
    generated_fraction: float = Field(0.5, ge=0, le=1)
    prompt_len: int = Field(128, ge=1)
    gen_tokens: int = Field(256, ge=1)
    gen_temperature: float = Field(0.0, ge=0)
    gen_batch: int = Field(256, ge=1)
    eval: bool = True
    eval_prompts: int = Field(64, ge=1)
    eval_max_tokens: int = Field(256, ge=1)
    eval_k: int | None = Field(None, ge=1)
    eval_dtype: str | None = None
    timing_prompts: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check(self):
        if self.generated and self.generated_fraction and self.prompt_len + self.gen_tokens > self.seq_len:
            raise ValueError(f"prompt_len + gen_tokens ({self.prompt_len + self.gen_tokens}) exceeds "
                             f"seq_len ({self.seq_len})")
        if self.eval_k is not None and self.eval_k > self.block_size - 1:
            raise ValueError(f"eval_k ({self.eval_k}) exceeds block_size - 1 ({self.block_size - 1})")
        return self

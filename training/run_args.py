"""The settings every `dflash train` run shares: where it writes, the schedule's length, saving,
resuming and the device. Each command's own flags extend `TrainRunArgs`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from foundation.byte_size import parse_byte_size


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

    @model_validator(mode="after")
    def _check_run(self):
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")
        parse_byte_size(self.max_shard_size)
        return self

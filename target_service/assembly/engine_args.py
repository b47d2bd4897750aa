"""EngineArgs: every engine setting as the user gave it, validated field by field; names are the
CLI's and `LLM`'s. What follows from them and the checkpoints is worked out once, in `EnginePlan`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from foundation.byte_size import parse_byte_size
from foundation.device_name import check_device_name
from foundation.validation_error import InvalidSetting

# No cap by default: on the H200 (Qwen3-8B shapes, 6 target layers) a cap of 512 made a varied
# workload 24% slower end to end with no shorter longest step (bench/results/compile_probe_h200.json,
# its "after" entry);
# what it does at 36 layers, where a 2,048-token chunk costs six times more, is not measured yet.
DEFAULT_PREFILL_WITH_DECODES = None


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str
    drafter: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1)
    # who drafts: "dflash" (the drafter), "ngram" (prompt lookup, no drafter), "hybrid" (per sequence
    # and step, the better of the two); None: dflash when a drafter is given, plain decoding otherwise
    speculative_method: Literal["dflash", "ngram", "hybrid"] | None = None
    # each step verifies the k (0..K) drafts that maximise tokens per second (DFlash only); None: on
    # on a GPU unless num_speculative_tokens pins K, off on a CPU (plan.adaptive_speculation)
    adaptive_speculation: bool | None = None
    prompt_lookup_min: int = Field(1, ge=1)  # the shortest n-gram prompt lookup matches
    prompt_lookup_max: int = Field(3, ge=1)  # ... and the longest (tried first)
    context_storage: Literal["paged", "dense"] = "paged"
    dtype: Literal["bfloat16", "float16", "float32", "bf16", "fp16", "fp32"] | None = None
    # "fp8": the target's K/V pages in float8 e4m3 with per-layer scales of 1.0 (half the bytes of bf16
    # per token, so about twice the tokens in the same pool, and half the attention's reads); outputs
    # then follow the fp8 cache, not the full-precision one. The draft context keeps the compute dtype.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    device: str | None = None
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    # prompt tokens a step prefills beside decodes or verifies (None: the rest of the step's budget):
    # the longest gap a long prompt's arrival puts in the running streams
    max_prefill_tokens_with_decodes: int | None = Field(DEFAULT_PREFILL_WITH_DECODES, ge=1)
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    tokens_per_block: int = 32
    enable_prefix_caching: bool = True
    seed: int | None = None
    enforce_eager: bool = False  # no CUDA graphs (they are captured only on a GPU)
    async_scheduling: bool = True  # queue the next step before reading this one
    cuda_graph_sizes: list[int] | None = None  # batch sizes to capture (default: 1-8, then to 64)

    # Field validators, not one model validator: an error then carries the field's name (the CLI
    # prints it as the flag, --kv-cache-memory), where a model-level error carries none.
    @field_validator("kv_cache_memory")
    @classmethod
    def _size(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_byte_size(value)
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        return value if value is None else check_device_name(value)


def engine_args(**settings) -> EngineArgs:
    """EngineArgs from keyword settings (the offline API's); a bad one is a one-line ValueError
    naming the setting, not pydantic's report."""
    try:
        return EngineArgs(**settings)
    except ValidationError as error:
        raise InvalidSetting(error) from None

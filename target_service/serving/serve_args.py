"""ServeArgs: every `dflash serve` setting, validated once; the field names are the flags'."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from foundation.byte_size import parse_byte_size
from foundation.device_name import check_device_name
from target_service.assembly.demo import resolve_pair
from target_service.assembly.engine_args import DEFAULT_PREFILL_WITH_DECODES, EngineArgs
from target_service.serving.spec_decode_metrics import SpecDecodeMetricsLevel

DRAIN_TIMEOUT_S = 30.0


class ServeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str | None = None  # None: the built-in demo pair
    drafter: str | None = None  # "none": plain decoding
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_port: int | None = Field(50051, ge=0, le=65535)  # replica i answers on admin_port + i; None: off
    replicas: int = Field(1, ge=1)
    address: str | None = None  # a Ray cluster to join; None: start a local Ray on loopback
    num_speculative_tokens: int | None = Field(None, ge=1)
    # who drafts (EngineArgs.speculative_method): dflash, ngram (prompt lookup), hybrid; None: dflash
    # with a drafter, plain decoding without
    speculative_method: Literal["dflash", "ngram", "hybrid"] | None = None
    # each step verifies the k of 0..K drafts with the most tokens per second (EngineArgs'); None: off
    adaptive_speculation: bool | None = None
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(3, ge=1)
    context_storage: Literal["paged", "dense"] = "paged"
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    device: str | None = None
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    kv_cache_memory: str | None = None
    max_num_batched_tokens: int = Field(2048, ge=16)
    max_prefill_tokens_with_decodes: int | None = Field(DEFAULT_PREFILL_WITH_DECODES, ge=1)
    # requests queued past this get 429; one request's choices (prompts x n) past it get 400, since no
    # wait would let them in
    max_waiting: int = Field(256, ge=1)
    # on a stop: how long the requests in flight may run on before they are stopped with an answer
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, ge=0, le=3600)
    api_key_file: str | None = None
    # Triton's compile cache for every replica (TRITON_CACHE_DIR in their processes): a directory that
    # outlives the server, so a restart loads its kernels instead of compiling them; None: Triton's
    # default (~/.triton/cache of the user running the replicas)
    compile_cache_dir: str | None = None
    admin_token_file: str | None = None
    served_model_name: str | None = None
    enforce_eager: bool = False
    async_scheduling: bool = True
    num_cpus_per_replica: float = Field(1.0, gt=0)  # Ray resources of one replica (CPU machines)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    # custom Ray resources one replica needs besides its CPUs and GPUs, e.g. {"dflash_gpu": 1} standing
    # in for a GPU on a CPU cluster; the flag takes JSON
    replica_resources: dict[str, float] = Field(default_factory=dict)
    # "inprocess": a replica runs the engine itself; "ray": it drives the pool, drafter and target as
    # three Ray actors of its own (target_service.assembly.ray_services), in its placement group
    services: Literal["inprocess", "ray"] = "inprocess"
    # vLLM's: each one-choice response carries its own speculative-decoding stats ("detailed": and
    # every step's counts); None: responses as without it (spec_decode_metrics.py)
    per_request_spec_decode_metrics: SpecDecodeMetricsLevel | None = None

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory(cls, value):
        if value is not None:
            parse_byte_size(value)
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        return None if value is None else check_device_name(value)

    @field_validator("replica_resources", mode="before")
    @classmethod
    def _resources_json(cls, value):
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"not JSON ({error}), got {value!r}") from None
        return value

    @field_validator("replica_resources")
    @classmethod
    def _custom_resources(cls, value):
        for name, amount in value.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name} has its own flag (--num-{name.lower()}s-per-replica)")
            if amount <= 0:
                raise ValueError(f"{name} needs a positive amount, got {amount}")
        return value

    @field_validator("compile_cache_dir")
    @classmethod
    def _writable_directory(cls, value):
        """An absolute directory this process can create and write (replicas run elsewhere: a
        relative path would name another directory in each)."""
        if value is None:
            return value
        path = Path(value)
        if not path.is_absolute():
            raise ValueError(f"{value} is not an absolute path")
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".dflash-write-check-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ValueError(f"cannot write to {value} ({error.strerror or error})") from None
        return value

    @field_validator("api_key_file", "admin_token_file")
    @classmethod
    def _readable(cls, value):
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{value} is not a readable file")
        return value

    def engine_args(self) -> EngineArgs:
        target, drafter = resolve_pair(self.target, self.drafter, self.speculative_method)
        return EngineArgs(target=target, drafter=drafter, num_speculative_tokens=self.num_speculative_tokens,
                          speculative_method=self.speculative_method,
                          adaptive_speculation=self.adaptive_speculation,
                          prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                          context_storage=self.context_storage, dtype=self.dtype,
                          kv_cache_dtype=self.kv_cache_dtype, device=self.device,
                          max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                          kv_cache_memory=self.kv_cache_memory, enable_prefix_caching=True,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          max_prefill_tokens_with_decodes=self.max_prefill_tokens_with_decodes,
                          enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "dflash-demo" if self.target is None else Path(self.target).resolve().name

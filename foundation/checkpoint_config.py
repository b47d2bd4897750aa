"""Validated views of the two `config.json` files the system reads: target (HF) and drafter (DFlash).

They live here, at the bottom of the import chain, because the pool's geometry is derived from
them (`kvpool_service.geometry`) and both model packages build on the same validated objects. A bad
file fails once, with one sentence naming the file and the field, before any work is done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from foundation.validation_error import describe

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
DTYPE_NAMES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


class ConfigError(ValueError):
    """A checkpoint config that cannot be used; the message names the file and the field."""


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class _LayerFields(BaseModel):
    """The decoder-layer fields shared by Qwen3 / Llama targets and DFlash drafters."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: PositiveInt = 32768
    attention_bias: bool = False
    vocab_size: PositiveInt | None = None
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    mlp_bias: bool = False
    use_sliding_window: bool = False

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        """Fill HF defaults and accept the newer `rope_parameters` / `dtype` spellings."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        rope = data.get("rope_parameters")
        if isinstance(rope, dict):
            data.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default" and data.get("rope_scaling") is None:
                data["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if data.get("torch_dtype") is None and isinstance(data.get("dtype"), str):
            data["torch_dtype"] = data["dtype"]
        if data.get("num_key_value_heads") is None:
            data["num_key_value_heads"] = data.get("num_attention_heads")
        if data.get("head_dim") is None and data.get("hidden_size") and data.get("num_attention_heads"):
            data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        return data

    @model_validator(mode="after")
    def _check_heads(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not _is_power_of_two(self.head_dim) or self.head_dim < 16:
            raise ValueError(f"head_dim must be a power of two >= 16, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; the SwiGLU MLP needs 'silu'")
        if self.mlp_bias:
            raise ValueError("mlp_bias=True is not supported: the MLP projections have no biases")
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported: every layer attends to all positions")
        if self.torch_dtype is not None and self.torch_dtype not in DTYPE_NAMES:
            raise ValueError(f"torch_dtype {self.torch_dtype!r} is not one of {sorted(set(DTYPE_NAMES))}")
        return self

    @property
    def dtype_name(self) -> str:
        """Canonical torch dtype name of the weights (bfloat16 when the config names none)."""
        return DTYPE_NAMES[self.torch_dtype] if self.torch_dtype else "bfloat16"


class TargetConfig(_LayerFields):
    """A Qwen3 or Llama HF `config.json`."""

    architectures: list[str] = Field(min_length=1)
    vocab_size: PositiveInt
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @model_validator(mode="after")
    def _check_architecture(self):
        if self.architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures[0] {self.architectures[0]!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return self

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


class DFlashFields(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    mask_token_id: int = Field(ge=0)
    target_layer_ids: list[int] | None = None


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps spread evenly from the 2nd layer to the 3rd from last (the DFlash release's rule)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


class DrafterConfig(_LayerFields):
    """A DFlash drafter `config.json`: Qwen3 layer fields plus the DFlash block and tap fields."""

    block_size: int = Field(ge=2)
    num_target_layers: PositiveInt
    dflash_config: DFlashFields

    @property
    def mask_token_id(self) -> int:
        return self.dflash_config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.target_layer_ids
        return list(ids) if ids else default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)


def check_drafter_fits(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Raise ConfigError unless `drafter` was built for `target` (one sentence, the field named)."""
    if drafter.hidden_size != target.hidden_size:
        raise ConfigError(
            f"drafter hidden_size {drafter.hidden_size} differs from the target's {target.hidden_size}"
        )
    if drafter.num_target_layers != target.num_hidden_layers:
        raise ConfigError(
            f"drafter num_target_layers {drafter.num_target_layers} differs from the target's "
            f"num_hidden_layers {target.num_hidden_layers}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ConfigError(
            f"drafter dflash_config.target_layer_ids {bad} are outside the target's layers "
            f"0..{target.num_hidden_layers - 1}"
        )
    if drafter.mask_token_id >= target.vocab_size:
        raise ConfigError(
            f"drafter dflash_config.mask_token_id {drafter.mask_token_id} is outside the target's "
            f"vocabulary of {target.vocab_size} tokens"
        )


def config_path(path: str | Path) -> Path:
    """`path` is a checkpoint directory or its config.json; return the config.json path."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not readable as JSON ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def _load(model: type[BaseModel], path: str | Path):
    file = config_path(path)
    try:
        return model.model_validate(_read_json(file))
    except ValidationError as error:
        raise ConfigError(f"{file}: {describe(error, lambda field: f'field {field!r}')}") from None


def load_target_config(path: str | Path) -> TargetConfig:
    """Read and validate a target config.json (or the checkpoint directory holding it)."""
    return _load(TargetConfig, path)


def load_drafter_config(path: str | Path) -> DrafterConfig:
    """Read and validate a DFlash drafter config.json (or the checkpoint directory holding it)."""
    return _load(DrafterConfig, path)


def check_rope(config, path: str | Path) -> None:
    """Raise ConfigError if the config's rope_theta / rope_scaling cannot be built (any model)."""
    from kernels.layers import rope_frequencies  # here, so reading a config does not import triton

    try:
        rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                         config.max_position_embeddings)
    except ValueError as error:
        raise ConfigError(f"{config_path(path)}: {error}") from None

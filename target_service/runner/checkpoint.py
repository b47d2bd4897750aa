"""Opening and loading a target checkpoint in HF layout.

A directory holds config.json, model.safetensors or a sharded model.safetensors.index.json,
optionally generation_config.json and tokenizer.json. `open_target_checkpoint` validates all of it
from the headers (config fields, tensor names and shapes, eos ids) without reading a weight, so a
bad checkpoint fails with one clear error before any work; `load_target` then allocates the model
and streams the weights in, logging progress (the CLI switches it off with `progress=False`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from tokenizers import Tokenizer

from foundation.checkpoint_config import ConfigError, TargetConfig, check_rope, load_target_config
from foundation.weights import CheckpointError, TensorIndex, check_tensors, load_weights, resolve_dtype
from target_service.runner.model import TargetModel, target_weight_layout

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"


class GenerationConfig(BaseModel):
    """The fields of generation_config.json the server uses."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    eos_token_id: int | list[int] | None = None


@dataclass(frozen=True)
class TargetCheckpoint:
    """A validated target checkpoint directory, weights not yet read.

    eos_token_ids: generation_config.json's first, then config.json's, without repeats.
    tokenizer: from tokenizer.json, or None (prompts must then be token ids).
    """

    path: Path
    config: TargetConfig
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer | None
    tensors: TensorIndex


def _generation_eos(directory: Path) -> list[int]:
    file = directory / GENERATION_CONFIG
    if not file.is_file():
        return []
    try:
        generation = GenerationConfig.model_validate(json.loads(file.read_text()))
    except (OSError, ValueError) as error:
        detail = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error)
        raise ConfigError(f"{file}: field 'eos_token_id': {detail}") from None
    eos = generation.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _eos_token_ids(directory: Path, config: TargetConfig) -> tuple[int, ...]:
    ids = tuple(dict.fromkeys(_generation_eos(directory) + config.eos_token_ids))
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ConfigError(
            f"{directory}: eos_token_id {bad} outside the vocabulary of {config.vocab_size} tokens"
        )
    return ids


def _tokenizer(directory: Path) -> Tokenizer | None:
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        logger.info("%s: no %s; prompts must be token ids", directory, TOKENIZER_FILE)
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the tokenizers library raises a bare Exception on bad files
        raise CheckpointError(f"{file}: not a readable tokenizer ({error})") from None


def open_target_checkpoint(path: str | Path) -> TargetCheckpoint:
    """Validate a target checkpoint directory (config, tensors from headers, eos ids, tokenizer)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a checkpoint directory")
    config = load_target_config(directory)
    check_rope(config, directory)
    tensors = TensorIndex(directory)
    check_tensors(tensors, target_weight_layout(config), f"{config.architecture} checkpoint")
    eos_token_ids = _eos_token_ids(directory, config)
    return TargetCheckpoint(directory, config, eos_token_ids, _tokenizer(directory), tensors)


def load_target(
    path: str | Path | TargetCheckpoint,
    *,
    tap_layer_ids: Iterable[int] = (),
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> tuple[TargetModel, TargetCheckpoint]:
    """Open (unless given open), allocate and load the target; dtype defaults to the config's.

    tap_layer_ids: the drafter's target_layer_ids, so forward returns their hidden states.
    """
    checkpoint = path if isinstance(path, TargetCheckpoint) else open_target_checkpoint(path)
    model_dtype = resolve_dtype(dtype, checkpoint.config.dtype_name)
    model = TargetModel(checkpoint.config, tap_layer_ids=tap_layer_ids, dtype=model_dtype, device=device)
    load_weights(model, checkpoint.tensors, target_weight_layout(checkpoint.config), progress=progress)
    return model.eval(), checkpoint

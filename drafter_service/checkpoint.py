"""Opening and loading a DFlash drafter checkpoint (config.json + safetensors; docs/architecture.md,
section 7).

Everything that can be checked is checked before a weight is read: the config fields, the fit with
the target (hidden size, layer count, tap ids, mask token), the rope scaling, and every tensor's
name and shape from the safetensors headers. One clear error names what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafter_service.model import DFlashDrafter, drafter_weight_layout
from foundation.checkpoint_config import (
    ConfigError,
    DrafterConfig,
    TargetConfig,
    check_drafter_fits,
    check_rope,
    config_path,
    load_drafter_config,
)
from foundation.weights import TensorIndex, check_tensors, load_weights, resolve_dtype


def open_drafter_checkpoint(path: str | Path, target: TargetConfig | None = None) -> tuple[DrafterConfig,
                                                                                           TensorIndex]:
    """Validate a drafter directory (and its fit with `target` when given) without reading weights."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a checkpoint directory")
    config = load_drafter_config(directory)
    if target is not None:
        check_drafter_fits(target, config)
    if config.attention_bias:
        raise ConfigError(f"{config_path(directory)}: field 'attention_bias': DFlash drafters have no biases")
    check_rope(config, directory)
    tensors = TensorIndex(directory)
    check_tensors(tensors, drafter_weight_layout(config), "DFlash drafter checkpoint")
    return config, tensors


def load_drafter(
    path: str | Path,
    target: TargetConfig | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> DFlashDrafter:
    """Validate, allocate and load a drafter; dtype defaults to the drafter config's."""
    config, tensors = open_drafter_checkpoint(path, target)
    model = DFlashDrafter(config, dtype=resolve_dtype(dtype, config.dtype_name), device=device)
    load_weights(model, tensors, drafter_weight_layout(config), progress=progress)
    return model.eval()

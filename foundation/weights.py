"""Reading safetensors checkpoints into a model's (fused) parameters, checked before any work.

Both models load the same way: a layout maps each checkpoint tensor name to a slice of one of
our parameters (q/k/v land in one fused projection, gate/up in another); `check_tensors` compares
the layout with the shapes in the safetensors headers (nothing is read yet), and only then
`load_weights` streams the tensors file by file into the allocated parameters. The target's loader
imports this too (imports flow drafter_service <- target_service).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple, TextIO

import torch
from safetensors import safe_open
from tqdm import tqdm

from foundation.checkpoint_config import DTYPE_NAMES, ConfigError, TargetConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LISTED = 4  # names shown in an error before "(+N more)"


class CheckpointError(ConfigError):
    """Checkpoint tensors that cannot serve the config: missing, mis-shaped, or unreadable files."""


class WeightSlot(NamedTuple):
    """Where one checkpoint tensor goes: rows row..row+shape[0]-1 of our parameter `param`."""

    param: str
    row: int
    shape: tuple[int, ...]


def token_tables_layout(config: TargetConfig) -> dict[str, WeightSlot]:
    """The target's embedding and output tables by their HF names (no lm_head tensor when tied).

    Both the target and the drafter load these (the drafter embeds its noise block and scores its
    drafts with the target's tables), each from the target checkpoint.
    """
    shape = (config.vocab_size, config.hidden_size)
    layout = {"model.embed_tokens.weight": WeightSlot("embed_tokens", 0, shape)}
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = WeightSlot("lm_head", 0, shape)
    return layout


def resolve_dtype(dtype: str | torch.dtype | None, default_name: str) -> torch.dtype:
    """The model dtype: `dtype` if given (torch dtype or a name like "bf16"), else the config's."""
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use bfloat16, float16 or float32")
        return dtype
    name = DTYPE_NAMES.get(dtype if dtype is not None else default_name)
    if name is None:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(set(DTYPE_NAMES))}")
    return MODEL_DTYPES[name]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" (+{len(names) - _LISTED} more)" if len(names) > _LISTED else "")


class TensorIndex:
    """Name -> (file, shape) of every tensor in a checkpoint directory, from the headers alone.

    Accepts a sharded `model.safetensors.index.json`, a single `model.safetensors`, or (as
    released drafters sometimes are) any other `*.safetensors` files in the directory.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for file in self._files():
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        self._file[name] = file
                        self._shape[name] = tuple(handle.get_slice(name).get_shape())
            except (OSError, ValueError, RuntimeError) as error:
                raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index}: no readable weight_map ({error!r})") from None
            files = [self.directory / name for name in dict.fromkeys(weight_map.values())]
            missing = [str(file.name) for file in files if not file.is_file()]
            if missing:
                raise CheckpointError(f"{index}: lists shard files that do not exist: {_listing(missing)}")
            return files
        if (self.directory / SINGLE_FILE).is_file():
            return [self.directory / SINGLE_FILE]
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self._shape

    def names(self) -> list[str]:
        return list(self._shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, cpu tensor) for `names`, one file opened at a time."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file[name], []).append(name)
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in file_names:
                    yield name, handle.get_tensor(name)


def check_tensors(index: TensorIndex, layout: Mapping[str, WeightSlot], what: str, *,
                  warn_unused: bool = True) -> None:
    """Raise one CheckpointError naming every missing or mis-shaped tensor; warn about extra ones
    (unless the caller reads a part of the checkpoint on purpose: `warn_unused=False`)."""
    missing = [name for name in layout if name not in index]
    misshaped = [
        f"{name} {list(index.shape(name))} (expected {list(entry.shape)})"
        for name, entry in layout.items()
        if name in index and index.shape(name) != tuple(entry.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {_listing(missing)}")
    if misshaped:
        problems.append(f"mis-shaped tensors {_listing(misshaped)}")
    if problems:
        raise CheckpointError(f"{index.directory}: does not hold a {what}: {'; '.join(problems)}")
    unexpected = [name for name in index.names() if name not in layout] if warn_unused else []
    if unexpected:
        logger.warning("%s: ignoring %d unused tensors: %s", index.directory, len(unexpected),
                       _listing(unexpected))


class LoadProgress:
    """Progress of one load, out of the way unless asked for.

    A bar on stderr when stderr is a terminal and the load has run over `delay` seconds (a small
    checkpoint loads without one); the tenths at DEBUG; one INFO line when `finish()` is called.
    `enabled=False` silences all three (callers that load many times, like tests and training).
    """

    def __init__(self, what: str, total_elements: int, total_tensors: int, enabled: bool = True, *,
                 stream: TextIO | None = None, delay: float = 1.0):
        self.what, self.total, self.tensors = what, max(total_elements, 1), total_tensors
        self.enabled = enabled
        self.done = self.count = self.reported = 0
        self.started = time.perf_counter()
        stream = sys.stderr if stream is None else stream
        self.bar = tqdm(total=total_elements, desc=what, unit="param", unit_scale=True, delay=delay,
                        file=stream, leave=False, disable=not (enabled and stream.isatty()))

    def advance(self, elements: int) -> None:
        self.done += elements
        self.count += 1
        self.bar.update(elements)
        tenth = self.done * 10 // self.total
        if self.enabled and tenth > self.reported:
            self.reported = tenth
            logger.debug("%s: %d%% (%d/%d tensors)", self.what, tenth * 10, self.count, self.tensors)

    def finish(self) -> None:
        self.bar.close()
        if self.enabled:
            logger.info("%s: %d tensors, %d elements in %.2f s", self.what, self.count, self.done,
                        time.perf_counter() - self.started)


def load_weights(
    module: torch.nn.Module, index: TensorIndex, layout: Mapping[str, WeightSlot], *, progress: bool = True
) -> None:
    """Copy every checkpoint tensor of `layout` into its slice of `module`'s parameters (cast, moved)."""
    params = dict(module.named_parameters())
    total = sum(math.prod(entry.shape) for entry in layout.values())
    meter = LoadProgress(f"loading {index.directory}", total, len(layout), progress)
    try:
        with torch.no_grad():
            for name, tensor in index.read(list(layout)):
                entry = layout[name]
                params[entry.param][entry.row : entry.row + entry.shape[0]].copy_(tensor)
                meter.advance(tensor.numel())
    finally:
        meter.finish()


def empty_param(shape, dtype: torch.dtype, device) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter: models allocate with this, then `load_weights` fills it."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

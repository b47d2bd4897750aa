"""Pool memory: one arena per layer group, per-layer K/V views, exported once and attached many times.

The whole pool is ONE byte buffer (a /dev/shm file on CPU, one CUDA allocation on GPU) carved into
aligned segments, so one handle shares everything:

    [header 4 KiB][target arena][target scales, fp8 only][draft arena][draft scales, fp8 only]

- arena of a group: `[num_blocks, L, 2, tokens_per_block, H, D]` in the group's dtype; the K cache of
  layer l is `arena[:, l, 0]` and its V cache `arena[:, l, 1]`, both `[num_blocks, tokens_per_block,
  H, D]` and strided (kernels take strides).
- scales of an fp8 group: fp32 `[L, 2]`, `[l, 0]` the K scale and `[l, 1]` the V scale of layer l,
  initialised to 1.0 and shared like the pages.
- header: magic, the pool's epoch, owner pid, and the layout as JSON. An attaching process checks it,
  so a handle that outlived its pool, or memory of another layout, is refused; the owner zeroes the
  epoch on close, so an attached process can notice (`check_epoch`) that its pool is gone.

The owner (`PoolMemory.create`) allocates and removes; attached processes (`PoolMemory.attach`) only
map. See `foundation.shm` for what happens to the /dev/shm file when the owner is killed, and
`foundation.cuda_ipc` for the CUDA lifetime rules.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from foundation.layer_cache import LayerCache
from foundation.shared_buffer import BufferHandle, OwnedBuffer, map_buffer
from foundation.shm import SHM_DIR, pool_file_name
from kvpool_service.errors import StaleEpoch
from kvpool_service.geometry import LayerGroup, PoolLayout

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096
SEGMENT_ALIGN = 4096  # page size on CPU; well above the 256 bytes CUDA kernels like
_MAGIC = b"DFLPOOL1"
_HEADER = struct.Struct("<8sQQI")  # magic, epoch, owner pid, length of the layout JSON
_EPOCH_BYTES = slice(8, 16)


class PoolAttachError(ValueError):
    """The handle or memory does not match the layout the attaching process expects."""


class StaleEpochError(PoolAttachError, StaleEpoch):
    """The handle or memory belongs to another epoch of the pool (it was closed or restarted).

    Also a `kvpool_service.errors.StaleEpoch`, so one except clause covers the control plane's
    epoch check and the memory's."""


@dataclass(frozen=True)
class Segment:
    """One typed region of the pool buffer."""

    name: str  # a group name ("target", "draft") or "<group>.scales"
    offset: int  # bytes from the start of the buffer
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _align(n: int) -> int:
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


def plan_segments(layout: PoolLayout) -> tuple[tuple[Segment, ...], int]:
    """Segments of `layout` in buffer order, and the buffer's total bytes."""
    segments = []
    offset = HEADER_BYTES
    for group in layout.spec.groups:
        shape = (layout.num_blocks, group.num_layers, 2, layout.spec.tokens_per_block,
                 group.num_kv_heads, group.head_dim)
        segments.append(Segment(group.name, offset, shape, getattr(torch, group.dtype)))
        offset = _align(offset + segments[-1].nbytes)
        if group.is_fp8:
            segments.append(Segment(f"{group.name}.scales", offset, (group.num_layers, 2), torch.float32))
            offset = _align(offset + segments[-1].nbytes)
    return tuple(segments), offset


@dataclass(frozen=True)
class PoolHandle:
    """What another process needs to map the pool: its layout (with the epoch) and its buffer.

    Picklable unless the pool is private to one process (`share=False`), whose handle is for the
    in-process assembly only. Never accept one from a network peer: unpickling a CUDA handle runs
    the function it names.
    """

    layout: PoolLayout
    buffer: BufferHandle

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def shm_path(self) -> str | None:
        return self.buffer.shm_path

    @property
    def cuda(self):
        return self.buffer.cuda


class PoolMemory:
    """The pool's arenas in one process, as their owner (`create`) or attached to one (`attach`)."""

    def __init__(self, layout: PoolLayout, buffer: torch.Tensor, *, is_owner: bool,
                 owned: OwnedBuffer | None = None):
        """Carve `buffer`; use `create` or `attach`, which check everything first."""
        self.layout = layout
        self.is_owner = is_owner
        self.shareable = owned is not None and owned.shareable
        self.device = buffer.device
        self.nbytes = buffer.numel()
        self._buffer: torch.Tensor | None = buffer
        self._owned = owned
        self._handle: PoolHandle | None = None
        segments, _ = plan_segments(layout)
        self._tensors = {s.name: buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
                         for s in segments}
        # Runs on close(), on garbage collection, and at interpreter exit; holds no reference to self.
        self._finalizer = (weakref.finalize(self, _release, buffer[:HEADER_BYTES], owned and owned.file)
                           if is_owner else None)

    @classmethod
    def create(cls, layout: PoolLayout, device: torch.device | str = "cpu", *, share: bool = True,
               shm_dir: Path | str = SHM_DIR, sweep_stale: bool = True) -> PoolMemory:
        """Allocate a zeroed pool for `layout` on `device` ("cpu" or "cuda[:i]").

        A shared CPU pool is a file in `shm_dir`; `sweep_stale` first removes pool files of dead
        owners (see `shm.sweep_stale_files`). `share=False` is for the one-process engine: private
        memory, no file, and a handle that cannot leave the process (on CUDA the allocation is the
        same either way).
        """
        if not isinstance(layout, PoolLayout):
            raise TypeError(f"layout must be a PoolLayout, got {type(layout).__name__}")
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"pool memory lives on 'cpu' or 'cuda', got device {str(device)!r}")
        _, nbytes = plan_segments(layout)
        owned = OwnedBuffer.allocate(nbytes, device, share=share, file_name=pool_file_name(layout.epoch),
                                     shm_dir=shm_dir, sweep_stale=sweep_stale)
        buffer = owned.tensor
        buffer[:HEADER_BYTES].copy_(_pack_header(layout))
        pool = cls(layout, buffer, is_owner=True, owned=owned)
        for name, tensor in pool._tensors.items():
            if name.endswith(".scales"):
                tensor.fill_(1.0)
        logger.info("pool memory of epoch %d: %d bytes on %s", layout.epoch, nbytes, buffer.device)
        return pool

    @classmethod
    def attach(cls, handle: PoolHandle, expected_layout: PoolLayout) -> PoolMemory:
        """Map the pool behind `handle`, refusing it unless it is exactly `expected_layout`.

        Raises PoolAttachError when the layouts differ (naming each differing field), and
        StaleEpochError when the handle or memory belongs to another epoch: the pool was closed or
        restarted, so the caller must fetch a fresh handle rather than read someone else's pages.
        """
        if not isinstance(handle, PoolHandle):
            raise TypeError(f"handle must be a PoolHandle, got {type(handle).__name__}")
        _check_layout(handle.layout, expected_layout)
        _, nbytes = plan_segments(expected_layout)
        if handle.nbytes != nbytes:
            raise PoolAttachError(f"the handle says the pool holds {handle.nbytes} bytes, "
                                  f"its layout needs {nbytes}")
        buffer = _map(handle)
        _check_header(_read_header(buffer), expected_layout)
        logger.info("attached to pool memory of epoch %d on %s", expected_layout.epoch, buffer.device)
        return cls(expected_layout, buffer, is_owner=False)

    def export(self) -> PoolHandle:
        """The handle others attach with (made once, then the same one every time).

        A pool created with share=False exports an in-process handle: the other assemblers of this
        process attach with it; pickling it (to send it to another process) raises TypeError.
        """
        self._open_buffer()
        if not self.is_owner:
            raise RuntimeError("only the pool's owner exports it; pass on the handle you attached with")
        if self._handle is None:
            self._handle = PoolHandle(self.layout, self._owned.export())
        return self._handle

    def arena(self, group: str) -> torch.Tensor:
        """The group's arena, `[num_blocks, L, 2, tokens_per_block, H, D]`."""
        self._open_buffer()
        return self._tensors[self._group(group).name]

    def scales(self, group: str) -> torch.Tensor:
        """The fp8 group's scales, fp32 `[L, 2]` (K scale, V scale per layer)."""
        self._open_buffer()
        spec = self._group(group)
        if not spec.is_fp8:
            raise ValueError(f"layer group {group!r} is {spec.dtype}; only fp8 groups carry scales")
        return self._tensors[f"{spec.name}.scales"]

    def layer(self, group: str, index: int) -> LayerCache:
        """K/V views (and scales, for fp8) of layer `index` of `group`."""
        spec = self._group(group)
        if not 0 <= index < spec.num_layers:
            raise IndexError(f"layer {index} is out of range for group {group!r} of {spec.num_layers} layers")
        arena = self.arena(group)
        if not spec.is_fp8:
            return LayerCache(arena[:, index, 0], arena[:, index, 1])
        scales = self.scales(group)
        return LayerCache(arena[:, index, 0], arena[:, index, 1], scales[index, 0], scales[index, 1])

    def layers(self, group: str) -> list[LayerCache]:
        return [self.layer(group, i) for i in range(self._group(group).num_layers)]

    def check_epoch(self) -> None:
        """Raise StaleEpochError if the memory no longer holds this epoch (the owner closed it).

        On CUDA this reads the header back to the host: call it on control paths, not per step.
        A killed owner never zeroes the epoch; the control plane's epoch catches that case.
        """
        epoch = _HEADER.unpack(_read_header(self._open_buffer())[:_HEADER.size])[1]
        if epoch != self.layout.epoch:
            raise StaleEpochError(f"pool memory now holds epoch {epoch} (0: closed by its owner), "
                                  f"this process attached to epoch {self.layout.epoch}")

    def close(self) -> None:
        """Drop this process's mapping; the owner also marks the epoch closed and removes the file.

        Idempotent. Views handed out earlier stay valid memory on CPU (the mapping lives while they
        do) but no longer belong to a live pool. On CUDA, torch keeps the owner's block alive until
        attached processes release their copies.
        """
        if self._finalizer is not None:
            self._finalizer()
        self._tensors = {}
        self._buffer = None

    def __enter__(self) -> PoolMemory:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        state = "closed" if self._buffer is None else str(self.device)
        return f"PoolMemory(epoch={self.layout.epoch}, {role}, {self.nbytes} bytes, {state})"

    def _open_buffer(self) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError(f"pool memory of epoch {self.layout.epoch} is closed")
        return self._buffer

    def _group(self, name: str) -> LayerGroup:
        for group in self.layout.spec.groups:
            if group.name == name:
                return group
        names = [g.name for g in self.layout.spec.groups]
        raise ValueError(f"unknown layer group {name!r}; this pool has {names}")


def _release(header: torch.Tensor, owned_file) -> None:
    header[_EPOCH_BYTES].zero_()  # attached processes see epoch 0: closed
    if owned_file is not None:
        owned_file.remove()


def _pack_header(layout: PoolLayout) -> torch.Tensor:
    body = layout.model_dump_json().encode()
    if _HEADER.size + len(body) > HEADER_BYTES:
        raise ValueError(f"pool layout JSON of {len(body)} bytes does not fit the {HEADER_BYTES}-byte header")
    raw = bytearray(HEADER_BYTES)
    _HEADER.pack_into(raw, 0, _MAGIC, layout.epoch, os.getpid(), len(body))
    raw[_HEADER.size:_HEADER.size + len(body)] = body
    return torch.frombuffer(raw, dtype=torch.uint8)


def _read_header(buffer: torch.Tensor) -> bytes:
    return buffer[:HEADER_BYTES].cpu().numpy().tobytes()


def _check_header(raw: bytes, expected: PoolLayout) -> None:
    magic, epoch, owner_pid, length = _HEADER.unpack(raw[:_HEADER.size])
    if magic != _MAGIC:
        raise PoolAttachError(f"the mapped memory is not a dflash pool (magic {magic!r})")
    if epoch != expected.epoch:
        raise StaleEpochError(f"pool memory holds epoch {epoch} (0: closed by its owner, pid {owner_pid}), "
                              f"expected epoch {expected.epoch}; fetch a fresh handle")
    stored = PoolLayout.model_validate_json(raw[_HEADER.size:_HEADER.size + length])
    _check_layout(stored, expected)


def _check_layout(actual: PoolLayout, expected: PoolLayout) -> None:
    if not isinstance(expected, PoolLayout):
        raise TypeError(f"expected_layout must be a PoolLayout, got {type(expected).__name__}")
    diffs = _differences(actual.model_dump(exclude={"epoch"}), expected.model_dump(exclude={"epoch"}))
    if diffs:
        raise PoolAttachError("pool layout mismatch: " + "; ".join(
            f"{key}: pool has {have!r}, expected {want!r}" for key, have, want in diffs))
    if actual.epoch != expected.epoch:
        raise StaleEpochError(f"the handle belongs to pool epoch {actual.epoch}, but the pool now has epoch "
                              f"{expected.epoch}: it was restarted; fetch a fresh handle")


def _differences(have: dict, want: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, have, want) for every leaf where two nested dicts differ."""
    out = []
    for key in sorted(have.keys() | want.keys()):
        a, b = have.get(key), want.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def _map(handle: PoolHandle) -> torch.Tensor:
    try:
        return map_buffer(handle.buffer)
    except FileNotFoundError as err:
        raise StaleEpochError(f"pool file {handle.shm_path} is gone: the pool of epoch {handle.layout.epoch} "
                              "was closed or its owner exited; fetch a fresh handle") from err
    except (ValueError, LookupError) as err:
        raise PoolAttachError(str(err)) from err

"""Share one CUDA buffer between processes with torch's CUDA IPC reductions, keyed by GPU UUID.

`reduce_tensor` returns `(rebuild_cuda_tensor, args)` where args[6] is the device INDEX in the
exporter's numbering. Two processes with different CUDA_VISIBLE_DEVICES number the same GPU
differently (pytorch issue 149196), so the handle carries the GPU's UUID and the attaching process
rewrites args[6] to its own index for that UUID (the pattern of vLLM's IPC weight transfer).

Contract (CUDA, not ours to change): the exporter must keep its tensor alive while any attached
process holds its copy; torch's IPC ref counting keeps freed blocks in limbo until then. Only the
write that happened before export is synchronised (through the IPC event in args[13:15]); later
writes need the caller's own ordering (a stream synchronise before signalling the other process).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

logger = logging.getLogger(__name__)

_DEVICE_ARG = 6  # index of storage_device in rebuild_cuda_tensor's arguments
_NUM_ARGS = 15


@dataclass(frozen=True)
class CudaIpcHandle:
    """A picklable handle to one CUDA tensor: the GPU's UUID plus torch's rebuild recipe."""

    gpu_uuid: str
    rebuild: Callable[..., torch.Tensor]
    args: tuple


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; LookupError naming the visible UUIDs if none."""
    visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if uuid in visible:
        return visible.index(uuid)
    raise LookupError(
        f"no visible CUDA device has UUID {uuid} (visible: {visible or 'none'}); the attaching process "
        "must see the pool's GPU (check CUDA_VISIBLE_DEVICES and the actor's GPU resources)"
    )


def indexed_cuda_device(device: torch.device | str, what: str) -> torch.device:
    """`device` as cuda:<index> (a bare "cuda" is the current device); ValueError naming `what` when
    it is not a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} live on a CUDA device, got {str(device)!r}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def export_buffer(buffer: torch.Tensor) -> CudaIpcHandle:
    """Handle to `buffer` (a CUDA tensor the caller keeps alive while others are attached)."""
    if buffer.device.type != "cuda":
        raise ValueError(f"CUDA IPC exports CUDA tensors, got a tensor on {buffer.device}")
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in alloc_conf.replace(" ", "").lower():
        # legacy cudaIpcGetMemHandle rejects VMM (expandable) memory; torch's fd-based path has open bugs
        logger.warning("exporting a CUDA pool with expandable_segments on; turn it off for the pool process")
    rebuild, args = reduce_tensor(buffer.detach())
    if rebuild is not rebuild_cuda_tensor or len(args) != _NUM_ARGS:
        raise RuntimeError(
            f"torch {torch.__version__} reduced a CUDA tensor to {getattr(rebuild, '__name__', rebuild)} "
            f"with {len(args)} arguments; this module expects rebuild_cuda_tensor with {_NUM_ARGS}"
        )
    return CudaIpcHandle(gpu_uuid=gpu_uuid(buffer.device.index), rebuild=rebuild, args=tuple(args))


def attach_buffer(handle: CudaIpcHandle) -> torch.Tensor:
    """Map the exported tensor on this process's index of the same GPU (another process only)."""
    args = list(handle.args)
    args[_DEVICE_ARG] = local_device_index(handle.gpu_uuid)
    return handle.rebuild(*args)

"""One byte buffer that several processes map by handle: the pool and the step buffers both use it.

Three kinds of memory, one handle type:
- a /dev/shm file on CPU (`shm_path`): created and locked by its owner (`foundation.shm`), mapped
  by anyone who has the path;
- one CUDA allocation on GPU (`cuda`): shared through CUDA IPC (`foundation.cuda_ipc`);
- private memory for the one-process engine (`in_process`): the tensor itself, so the three
  assemblers meet through handles even when they share a process. Such a handle refuses to be
  pickled: private memory cannot reach another process, and failing loudly beats a silent copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from foundation.cuda_ipc import CudaIpcHandle, attach_buffer, export_buffer
from foundation.shm import SHM_DIR, OwnedFile, map_file, sweep_stale_files


@dataclass(frozen=True)
class BufferHandle:
    """What another process needs to map one buffer: exactly one of the three kinds."""

    nbytes: int
    shm_path: str | None = None
    cuda: CudaIpcHandle | None = None
    in_process: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        kinds = sum(value is not None for value in (self.shm_path, self.cuda, self.in_process))
        if kinds != 1:
            raise ValueError("a buffer handle carries exactly one of shm_path (CPU), cuda (GPU) and "
                             "in_process (one process)")

    def __reduce__(self):
        if self.in_process is not None:
            raise TypeError("an in-process buffer handle cannot leave its process: create the buffer "
                            "with share=True to hand it to another process")
        return (BufferHandle, (self.nbytes, self.shm_path, self.cuda))


@dataclass
class OwnedBuffer:
    """A buffer this process allocated: the bytes, and the /dev/shm file behind them (if any)."""

    tensor: torch.Tensor
    file: OwnedFile | None
    shareable: bool

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device | str, *, share: bool, file_name: str,
                 shm_dir: Path | str = SHM_DIR, sweep_stale: bool = True) -> OwnedBuffer:
        """Zeroed bytes on `device`; a shared CPU buffer is the file `shm_dir/file_name`.

        `share=False` gives private memory (no file): its handle is an in-process one. On CUDA the
        allocation is the same either way; `share` only says whether the handle may leave.
        `sweep_stale` first removes /dev/shm files of dead owners.
        """
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"shared buffers live on 'cpu' or 'cuda', got device {str(device)!r}")
        if device.type == "cpu" and share:
            shm_dir = Path(shm_dir)
            if sweep_stale:
                sweep_stale_files(shm_dir)
            owned = OwnedFile.create(shm_dir, file_name, nbytes)
            try:
                return cls(owned.map(), owned, True)
            except BaseException:
                owned.remove()
                raise
        return cls(torch.zeros(nbytes, dtype=torch.uint8, device=device), None, share)

    def export(self) -> BufferHandle:
        if not self.shareable:
            return BufferHandle(self.tensor.numel(), in_process=self.tensor)
        if self.file is not None:
            return BufferHandle(self.tensor.numel(), shm_path=str(self.file.path))
        return BufferHandle(self.tensor.numel(), cuda=export_buffer(self.tensor))


def map_buffer(handle: BufferHandle) -> torch.Tensor:
    """The bytes behind `handle` in this process.

    Raises FileNotFoundError when a /dev/shm file is gone (its owner closed), ValueError when its
    size differs from the handle's, and LookupError when no visible GPU is the handle's.
    """
    if not isinstance(handle, BufferHandle):
        raise TypeError(f"handle must be a BufferHandle, got {type(handle).__name__}")
    if handle.in_process is not None:
        buffer = handle.in_process
    elif handle.shm_path is not None:
        return map_file(Path(handle.shm_path), handle.nbytes)
    else:
        buffer = attach_buffer(handle.cuda)
    if buffer.dtype != torch.uint8 or buffer.numel() != handle.nbytes:
        raise ValueError(f"the handle maps {buffer.numel()} {buffer.dtype} elements, expected "
                         f"{handle.nbytes} uint8")
    return buffer

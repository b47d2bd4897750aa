"""The /dev/shm file behind a CPU pool: created and locked by its owner, mapped by anyone, swept when dead.

Why a plain file and not `multiprocessing.shared_memory`: on Python < 3.13 the resource tracker of an
*attaching* process unlinks the segment when that process exits, pulling the pool from under its
owner. A file mapped with `torch.from_file(..., shared=True)` has no tracker; its owner alone unlinks it.

Lifetime, and what happens when the owner dies:
- The owner creates the file unnamed (O_TMPFILE), takes an exclusive `flock` on it, reserves its
  bytes (`posix_fallocate`, so a /dev/shm too small fails here with a clear error instead of a
  SIGBUS on first touch), and only then links it under its name. So a named pool file is always
  either locked by a live owner or orphaned; there is no window where a sweeper could mistake a
  pool being born for a dead one.
- A normal close or interpreter exit unlinks the file (the owner's `weakref.finalize`, which runs
  at exit too). Processes that mapped it keep their mapping until they drop it: POSIX unlink only
  removes the name.
- SIGKILL, SIGTERM without a handler, or `os._exit` (a forked multiprocessing child) skip the
  finalizer and leave the file behind. The kernel releases the flock with the process, so the next
  `sweep_stale_files` (run by every new CPU pool at start-up) sees an unlocked file and removes it.
  The lock, not the pid in the name, is the liveness test: it is immune to pid reuse and to pid
  namespaces (two containers sharing one /dev/shm). The pid in the name is for people.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
FILE_PREFIX = "dflash-pool-"
# Every file an `OwnedFile` may be named with: pools, step buffers, step channels. A dead target
# leaves its step buffers and channel behind as a dead pool leaves its pages; one sweep takes all.
SWEPT_PREFIXES = (FILE_PREFIX, "dflash-step-", "dflash-channel-")


def pool_file_name(epoch: int) -> str:
    """`dflash-pool-<owner pid>-<epoch hex>`: one name per pool instance, never reused."""
    return f"{FILE_PREFIX}{os.getpid()}-{epoch:016x}"


class OwnedFile:
    """A pool file this process created and holds locked until `remove()`."""

    def __init__(self, path: Path, fd: int, nbytes: int):
        self.path = path
        self.nbytes = nbytes
        self._fd: int | None = fd

    @classmethod
    def create(cls, directory: Path, name: str, nbytes: int) -> OwnedFile:
        if nbytes <= 0:
            raise ValueError(f"a pool file needs a positive size, got {nbytes} bytes")
        if not directory.is_dir():
            raise FileNotFoundError(f"shared-memory directory {directory} does not exist")
        path = directory / name
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _reserve(fd, nbytes, directory)
            # Give the locked, sized file its name; fails (never clobbers) if the name exists.
            # A dir_fd makes CPython call linkat(AT_SYMLINK_FOLLOW), which resolves the /proc
            # link to the open file; plain link() would try to hard-link the symlink itself.
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.close(dir_fd)
        logger.info("created pool file %s (%d bytes)", path, nbytes)
        return cls(path, fd, nbytes)

    def map(self) -> torch.Tensor:
        """The whole file as a shared uint8 tensor (writes reach every process that maps it)."""
        return map_file(self.path, self.nbytes)

    def remove(self) -> None:
        """Unlink the file and release the lock; idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None
        logger.info("removed pool file %s", self.path)


def _reserve(fd: int, nbytes: int, directory: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        raise OSError(
            err.errno,
            f"cannot reserve {nbytes} bytes for the pool in {directory} ({free} bytes free): "
            f"{err.strerror}; give the pool less memory or mount a larger {directory}",
        ) from err


def map_file(path: Path, nbytes: int) -> torch.Tensor:
    """Map an existing pool file of exactly `nbytes` bytes as a shared uint8 tensor.

    Raises FileNotFoundError when the file is gone (its owner closed) and ValueError when its size
    differs (a different pool reused the path, which the epoch in the name should make impossible).
    """
    size = os.stat(path).st_size  # FileNotFoundError when the owner has closed
    if size != nbytes:
        raise ValueError(f"pool file {path} holds {size} bytes, the handle says {nbytes}")
    # from_file maps MAP_SHARED and closes its descriptor; the mapping keeps the memory alive.
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def sweep_stale_files(directory: Path = SHM_DIR) -> list[Path]:
    """Remove the files of dead owners (pools, step buffers, step channels: nobody holds their lock);
    return what was removed.

    Safe to run at any time from any process: a live owner's lock makes its file untouchable.
    """
    removed = []
    for path in sorted(p for prefix in SWEPT_PREFIXES for p in directory.glob(f"{prefix}*")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, PermissionError):
            continue  # closed meanwhile, or another user's pool
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live owner holds it
        try:
            os.unlink(path)
            removed.append(path)
            logger.warning("removed %s, left behind by a dead owner", path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed

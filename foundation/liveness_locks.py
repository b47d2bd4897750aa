"""Who is still alive on a shared file, told by locks rather than pids.

A lock dies with the process that held it (even under SIGKILL), so it is immune to zombies, pid
reuse and pid namespaces, where a pid check is not. Two kinds on one file, which do not interact:
- the owner's exclusive `flock` on the whole file (taken by `foundation.shm.OwnedFile`): another
  process cannot take a shared flock while the owner lives;
- an attached peer's open-file-description lock (F_OFD_SETLK) on the file's first byte: one peer at
  a time, and anyone can ask whether some live process holds it (F_OFD_GETLK).
"""

from __future__ import annotations

import fcntl
import os
import struct

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid
_PEER_BYTE = (0, 1)  # (start, len) of the byte the peer's OFD lock covers


def owner_alive(fd: int) -> bool:
    """Whether the file's owner still holds its exclusive flock (a shared one cannot be taken)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def take_peer_lock(fd: int) -> bool:
    """Hold the peer lock through `fd` (released when its last descriptor closes); False if a live
    process holds it already."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, *_PEER_BYTE, 0))
    except BlockingIOError:
        return False
    return True


def peer_alive(fd: int) -> bool:
    """Whether some open file description (a live peer) holds the peer lock."""
    probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, *_PEER_BYTE, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK

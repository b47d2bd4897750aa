"""StepChannel: a request/response mailbox of int64 words in a small /dev/shm file, for per-step calls.

When the target and the drafter run as separate processes (two Ray actors on one machine), each
step makes two calls on the drafter that carry only a few ints (`DraftControl`): the data is in the
step buffers both map. A Ray or gRPC round trip costs about a millisecond, a fifth of a 5 ms step;
this channel costs tens of microseconds. The caller ("target") creates it and exports a picklable
`StepChannelHandle`; one server ("drafter") at a time attaches and answers.

Layout, int64 words (each side writes only its own words; the caller's and the server's words sit
on separate cache lines):

    caller:  0 request_seq   1 writing_seq   2 request_epoch   3 opcode   4 num_args   5.. args
    server:  16 response_seq   17 status   18 result   19 message_len   20 handler_ns (all calls so far)
    set up:  24 magic   25 epoch (bumped by each attach)   26 server_pid   27 caller_pid
    bytes 256..767: the server's error message (utf-8, truncated)

Protocol. The caller writes writing_seq = s, then the request, then request_seq = s (last): the
server, seeing a new request_seq, reads the request and then writing_seq, and retries if the caller
has meanwhile started a newer request (a seqlock: after a timeout the caller may overwrite a
request the server is reading). The server runs the handler, writes status, result and message,
then response_seq = s (last); the caller returns once response_seq == s. A late answer to an
abandoned call carries an older seq and is never mistaken for the current one.

Memory-ordering assumption: every word is one aligned 8-byte numpy store or load, each its own C
call, so neither the compiler nor the interpreter reorders them, and x86-64 (total store order)
keeps stores in program order as seen by another core and loads in program order. A weaker memory
model (aarch64) would need explicit fences between the request and its seq; none is issued here.

Liveness, by locks rather than pids (`foundation.liveness_locks`): the owner holds an exclusive
`flock` on the file; the attached server holds an open-file-description lock on its first byte.
Each side checks the other's lock every CHECK_INTERVAL_S while it waits and raises `PeerGone` when
it is free: a killed server is
noticed within milliseconds instead of hanging the target. A second server cannot attach while
one holds the lock; a new server after a death bumps `epoch`, and serves only requests stamped
with its own epoch, so a request addressed to the dead server is never run by its successor (the
caller waiting on it gets `PeerGone`).

Waiting spins for SPIN_S (back-to-back calls answer in microseconds), then blocks on a futex over
the awaited seq word (`foundation.futex`), woken by the writer's FUTEX_WAKE right after it publishes:
an idle drafter costs no core, and a request arriving while it sleeps waits tens of microseconds,
not a sleep interval (sleep-polling up to 0.5 ms cost ~0.3 ms a call after an idle gap). The spin
yields the CPU at each poll (`sched_yield`): on two busy cores a caller spinning flat out kept the
server it had just woken off the cores, ~125 us per wake instead of ~25. The futex wait times out
every CHECK_INTERVAL_S so the liveness and stop checks still run.

GPU ordering: when the step buffers are CUDA memory, `create(device="cuda")` adds an ordering
object with four verbs: the caller marks "inputs ready" on its current stream before signalling,
the server's current stream waits for it before the handler and marks "outputs ready" after it,
the caller's current stream waits for that after the answer. No host sync. Which mechanism
(`ordering=`: stream flags, IPC events or "auto") is `foundation.gpu_ordering`'s choice.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from foundation import futex
from foundation.gpu_ordering import (
    GpuOrdering,
    GpuOrderingHandle,
    attach_ordering,
    check_ordering,
    create_ordering,
)
from foundation.liveness_locks import owner_alive, peer_alive, take_peer_lock
from foundation.shm import SHM_DIR, OwnedFile, map_file

logger = logging.getLogger(__name__)

MAX_ARGS = 8
MESSAGE_BYTES = 512
_HEADER_BYTES = 256
NBYTES = _HEADER_BYTES + MESSAGE_BYTES
MAGIC = int.from_bytes(b"dfchan01", "little")

# word indices (see the module docstring)
_REQUEST_SEQ, _WRITING_SEQ, _REQUEST_EPOCH, _OPCODE, _NUM_ARGS, _ARGS = 0, 1, 2, 3, 4, 5
_RESPONSE_SEQ, _STATUS, _RESULT, _MESSAGE_LEN, _HANDLER_NS = 16, 17, 18, 19, 20
_MAGIC, _EPOCH, _SERVER_PID, _CALLER_PID = 24, 25, 26, 27

STATUS_OK, STATUS_ERROR = 0, 1
SPIN_S = 100e-6  # poll a word this long (yielding the CPU each time) before blocking on its futex
CHECK_INTERVAL_S = 2e-3  # how often a waiter checks its peer's lock (and a server should_stop)
_INT64 = (-(2**63), 2**63 - 1)

Handler = Callable[[int, tuple[int, ...]], "int | None"]  # (opcode, args) -> result


class PeerGone(RuntimeError):
    """The other side of the channel is gone (exited, killed or closed); `epoch` is the one called."""

    def __init__(self, message: str, epoch: int = 0):
        super().__init__(message)
        self.epoch = epoch


class RemoteError(RuntimeError):
    """The server's handler raised; the message is the text it wrote back (type: message)."""


@dataclass(frozen=True)
class StepChannelHandle:
    """What a server needs to attach: the file, its size, and the GPU ordering's handle (GPU only)."""

    path: str
    nbytes: int
    ordering: GpuOrderingHandle | None = None


class StepChannel:
    """One end of a channel: the owner's (`create`, then `call`) or the server's (`attach`, then serve)."""

    def __init__(self, path: Path, buffer: torch.Tensor, fd: int, *, owned: OwnedFile | None,
                 ordering: GpuOrdering | None, seq: int = 0):
        self.path = path
        self.ordering = ordering
        self._buffer = buffer  # keeps the mapping alive
        self._bytes = buffer.numpy()
        self._words = self._bytes.view(np.int64)
        self._address = self._bytes.ctypes.data  # of word 0, for the futexes
        self._fd: int | None = fd  # the owner's probe of the server lock; the server's lock itself
        self._owned = owned
        self._seq = seq  # the owner: the last request sent; the server: the last request seen
        self._epoch = int(self._words[_EPOCH])  # the server: its own epoch
        self._posted: tuple | None = None  # the owner: a request sent by post() and not yet answered
        self.wait_s = 0.0  # the owner: seconds spent waiting for answers (calls, and settling posts)

    # ---- both sides ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """How many servers have attached so far; the current server's number."""
        return int(self._words[_EPOCH])

    @property
    def server_pid(self) -> int:
        """The pid the latest server recorded on attach (0 before any); it may since have died."""
        return int(self._words[_SERVER_PID])

    @property
    def caller_pid(self) -> int:
        return int(self._words[_CALLER_PID])

    def close(self) -> None:
        """The owner removes the file (an attached server then sees PeerGone); a server detaches,
        freeing its lock so a successor may attach. Idempotent."""
        if self._fd is None:
            return
        if self._owned is None and self.server_pid == os.getpid():
            self._words[_SERVER_PID] = 0
        os.close(self._fd)
        self._fd = None
        if self._owned is not None:
            self._owned.remove()
        self._buffer = self._bytes = self._words = None
        self.ordering = None

    # ---- the caller (owner) ----------------------------------------------------------------------

    @classmethod
    def create(cls, name: str | None = None, *, device: torch.device | str = "cpu",
               shm_dir: Path | str = SHM_DIR, ordering: str = "auto") -> StepChannel:
        """A new channel file `shm_dir/name`; `device` is where the step buffers live (CUDA adds the
        GPU ordering: `ordering` "flags", "events" or "auto", see the module docstring)."""
        _warn_if_not_x86()
        name = name or f"dflash-channel-{os.getpid()}-{os.urandom(6).hex()}"
        check_ordering(ordering)
        device = torch.device(device)
        gpu_ordering = create_ordering(device, ordering) if device.type == "cuda" else None
        owned = OwnedFile.create(Path(shm_dir), name, NBYTES)
        try:
            buffer = owned.map()
            fd = os.open(owned.path, os.O_RDWR)
        except BaseException:
            owned.remove()
            raise
        words = buffer.numpy().view(np.int64)
        words[_CALLER_PID] = os.getpid()
        words[_MAGIC] = MAGIC
        return cls(owned.path, buffer, fd, owned=owned, ordering=gpu_ordering)

    def export(self) -> StepChannelHandle:
        if self._owned is None:
            raise RuntimeError("only the channel's owner exports it; pass on the handle you attached with")
        return StepChannelHandle(str(self.path), NBYTES, self.ordering.export() if self.ordering else None)

    def wait_for_server(self, timeout_s: float, *, after_epoch: int = 0) -> int:
        """Wait until a live server with epoch > after_epoch is attached; return its epoch.

        After a PeerGone, pass its `epoch` to wait for the successor rather than the dead server.
        """
        self._require_owner()
        deadline = time.monotonic() + timeout_s
        while True:
            epoch = self.epoch
            if epoch > after_epoch and self._server_alive():
                return epoch
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no server attached to step channel {self.path} within {timeout_s:g} s "
                                   f"(epoch {epoch}, waiting for one above {after_epoch})")
            time.sleep(1e-3)

    def call(self, opcode: int, *args: int, timeout_s: float | None = None) -> int:
        """Send `opcode(*args)` and wait for the answer; return the handler's int result (0 for None).

        Raises PeerGone when the server dies, closes or is replaced while this call waits (or none
        has attached), TimeoutError after `timeout_s` (None: as long as the server lives), and
        RemoteError when the handler raised. A posted call still outstanding is settled first (its
        error raised). Not thread-safe: one caller thread per channel.
        """
        self._require_owner()
        self.settle()
        return self._answer_of(*self._publish(opcode, args, timeout_s))

    def post(self, opcode: int, *args: int, timeout_s: float | None = None) -> None:
        """Send `opcode(*args)` without waiting: the server works while the caller goes on. The next
        call, post or `settle()` waits for its answer first and raises its error; its result is
        dropped. For calls whose outputs the caller does not read back (on CUDA, the caller's stream
        still waits on the server's work when the answer is settled)."""
        self._require_owner()
        self.settle()
        self._posted = self._publish(opcode, args, timeout_s)

    def settle(self) -> None:
        """Wait for the posted call's answer, if one is outstanding; raise its error (it is dropped
        either way, so a caller that handled the error goes on with a clean channel)."""
        posted, self._posted = self._posted, None
        if posted is not None:
            self._answer_of(*posted)

    def _publish(self, opcode: int, args, timeout_s: float | None) -> tuple:
        opcode, args = int(opcode), [int(arg) for arg in args]
        if len(args) > MAX_ARGS:
            raise ValueError(f"a step channel call carries at most {MAX_ARGS} ints, got {len(args)}")
        if not all(_INT64[0] <= value <= _INT64[1] for value in (opcode, *args)):
            raise ValueError(f"opcode {opcode} and args {args} must fit int64 words")
        words, epoch = self._words, self.epoch
        if epoch == 0:
            raise PeerGone(f"no server has attached to step channel {self.path}; wait_for_server() first")
        self._seq = seq = self._seq + 1
        words[_WRITING_SEQ] = seq
        words[_REQUEST_EPOCH] = epoch
        words[_OPCODE] = opcode
        words[_NUM_ARGS] = len(args)
        words[_ARGS:_ARGS + len(args)] = args
        if self.ordering is not None:
            self.ordering.inputs_written(seq)
        words[_REQUEST_SEQ] = seq  # last: publishes the request
        futex.wake(self._address + 8 * _REQUEST_SEQ)
        return seq, epoch, opcode, timeout_s

    @property
    def server_busy_s(self) -> float:
        """Seconds the attached servers have spent in their handlers so far (read by either side:
        with `wait_s`, how much of the owner's waiting was the server's work and how much the channel's)."""
        return int(self._words[_HANDLER_NS]) / 1e9

    def _answer_of(self, seq: int, epoch: int, opcode: int, timeout_s: float | None) -> int:
        words = self._words
        started = time.perf_counter()
        try:
            self._wait_answer(seq, epoch, opcode, timeout_s)
        except PeerGone:
            release = getattr(self.ordering, "release", None)  # the flags have one; events need none
            if release is not None:
                release(seq)  # the dead server may owe a mark a waiting stream holds for
            raise
        finally:
            self.wait_s += time.perf_counter() - started
        status, result = int(words[_STATUS]), int(words[_RESULT])
        if self.ordering is not None:
            self.ordering.wait_outputs(seq)  # also after an error: the server marked it either way
        if status != STATUS_OK:
            raise RemoteError(f"step channel server pid {self.server_pid}, opcode {opcode}: "
                              f"{self._message()}")
        return result

    def _wait_answer(self, seq: int, epoch: int, opcode: int, timeout_s: float | None) -> None:
        words, pid = self._words, self.server_pid  # pid as of the call: a closing server zeroes it
        start = time.monotonic()
        spin_until, next_check = start + SPIN_S, start + CHECK_INTERVAL_S
        while (answered := int(words[_RESPONSE_SEQ])) != seq:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_INTERVAL_S
                if words[_RESPONSE_SEQ] == seq:
                    return  # answered, whatever became of the server since
                if self.epoch != epoch:
                    raise PeerGone(f"step channel server pid {pid} (epoch {epoch}) was replaced by pid "
                                   f"{self.server_pid} (epoch {self.epoch}) before answering opcode {opcode}",
                                   epoch)
                if not self._server_alive():
                    raise PeerGone(f"step channel server pid {pid} is gone (opcode {opcode} unanswered)",
                                   epoch)
                if timeout_s is not None and now - start >= timeout_s:
                    raise TimeoutError(f"step channel server pid {pid} did not answer opcode {opcode} "
                                       f"within {timeout_s:g} s")
            if now >= spin_until:
                futex.wait(self._address + 8 * _RESPONSE_SEQ, answered, next_check - now)
            else:
                os.sched_yield()

    def _server_alive(self) -> bool:
        return peer_alive(self._fd)

    def _message(self) -> str:
        length = min(int(self._words[_MESSAGE_LEN]), MESSAGE_BYTES)
        return self._bytes[_HEADER_BYTES:_HEADER_BYTES + length].tobytes().decode("utf-8", errors="replace")

    def _require_owner(self) -> None:
        if self._owned is None:
            raise RuntimeError("only the channel's owner calls; the attached side serves")

    # ---- the server ------------------------------------------------------------------------------

    @classmethod
    def attach(cls, handle: StepChannelHandle) -> StepChannel:
        """Become the channel's server: map the file, take the server lock, bump the epoch.

        Raises FileNotFoundError (the file is gone), ValueError (not a step channel of this size),
        PeerGone (its owner is dead) and RuntimeError (another live server is attached).
        """
        _warn_if_not_x86()
        if not isinstance(handle, StepChannelHandle):
            raise TypeError(f"handle must be a StepChannelHandle, got {type(handle).__name__}")
        path = Path(handle.path)
        buffer, fd = _open_channel_file(path, handle.nbytes)
        try:
            words = buffer.numpy().view(np.int64)
            _check_owner_alive(fd, path, int(words[_CALLER_PID]))
            if not take_peer_lock(fd):
                raise RuntimeError(f"step channel {path} already has a live server (pid "
                                   f"{int(words[_SERVER_PID])}); close it before attaching another")
            gpu_ordering = attach_ordering(handle.ordering)
        except BaseException:
            os.close(fd)
            raise
        # Requests up to here are stamped with an older epoch: skipped, whenever they are published.
        seen = int(words[_REQUEST_SEQ])
        words[_SERVER_PID] = os.getpid()
        words[_EPOCH] = int(words[_EPOCH]) + 1  # last: callers stamp new requests with this epoch
        channel = cls(path, buffer, fd, owned=None, ordering=gpu_ordering, seq=seen)
        logger.info("attached to step channel %s as server pid %d, epoch %d", path, os.getpid(),
                    channel._epoch)
        return channel

    def serve_one(self, handler: Handler, timeout_s: float | None = None, *, spin_s: float = SPIN_S) -> bool:
        """Answer one request with `handler(opcode, args)`; False if none came within `timeout_s`.

        A handler's Exception goes back to the caller as RemoteError (and to this process's log);
        serving goes on. Raises PeerGone when the channel's owner is gone.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request = self._next_request(lambda: deadline is not None and time.monotonic() >= deadline, spin_s)
        if request is None:
            return False
        self._answer(handler, *request)
        return True

    def serve_forever(self, handler: Handler, should_stop: Callable[[], bool] | None = None, *,
                      spin_s: float = SPIN_S) -> None:
        """Answer requests until `should_stop()` (asked every CHECK_INTERVAL_S while idle) is true.

        Raises PeerGone when the channel's owner is gone (nobody is left to call).
        """
        stop = should_stop or (lambda: False)
        while (request := self._next_request(stop, spin_s)) is not None:
            self._answer(handler, *request)

    def _next_request(self, should_stop: Callable[[], bool], spin_s: float
                      ) -> tuple[int, int, tuple[int, ...]] | None:
        """(seq, opcode, args) of the next request of this epoch, or None once should_stop()."""
        if self._owned is not None:
            raise RuntimeError("the channel's owner calls; serve from the attached side")
        words, start = self._words, time.monotonic()
        spin_until, next_check = start + spin_s, start + CHECK_INTERVAL_S
        while True:
            seq = int(words[_REQUEST_SEQ])
            if seq != self._seq:
                epoch, opcode, num_args = (int(words[i]) for i in (_REQUEST_EPOCH, _OPCODE, _NUM_ARGS))
                args = tuple(words[_ARGS:_ARGS + min(max(num_args, 0), MAX_ARGS)].tolist())
                if int(words[_WRITING_SEQ]) != seq:  # the caller is writing a newer request over
                    os.sched_yield()  # this one (it gave up on it): let it finish, then read that
                    continue
                self._seq = seq
                if epoch == self._epoch:
                    return seq, opcode, args
                logger.debug("skipped request %d addressed to epoch %d (this server is %d)", seq, epoch,
                             self._epoch)
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_INTERVAL_S
                _check_owner_alive(self._fd, self.path, self.caller_pid)
                if should_stop():
                    return None
            if now >= spin_until:
                futex.wait(self._address + 8 * _REQUEST_SEQ, self._seq, next_check - now)
            else:
                os.sched_yield()

    def _answer(self, handler: Handler, seq: int, opcode: int, args: tuple[int, ...]) -> None:
        started = time.perf_counter_ns()
        if self.ordering is not None:
            self.ordering.wait_inputs(seq)
        status, result, message = STATUS_OK, 0, b""
        try:
            value = handler(opcode, args)
            result = 0 if value is None else int(value)
            if not _INT64[0] <= result <= _INT64[1]:
                raise OverflowError(f"handler result {result} does not fit an int64 word")
        except Exception as error:
            logger.exception("step channel handler failed on opcode %d, args %s", opcode, args)
            status, result = STATUS_ERROR, 0
            message = _truncate_utf8(f"{type(error).__name__}: {error}", MESSAGE_BYTES)
        if self.ordering is not None:
            self.ordering.outputs_written(seq)
        words = self._words
        words[_HANDLER_NS] += time.perf_counter_ns() - started  # only the server writes it
        self._bytes[_HEADER_BYTES:_HEADER_BYTES + len(message)] = np.frombuffer(message, dtype=np.uint8)
        words[_MESSAGE_LEN] = len(message)
        words[_RESULT] = result
        words[_STATUS] = status
        words[_RESPONSE_SEQ] = seq  # last: publishes the answer
        futex.wake(self._address + 8 * _RESPONSE_SEQ)


def _open_channel_file(path: Path, nbytes: int) -> tuple[torch.Tensor, int]:
    """Map the channel file and open a descriptor for its locks, with one-line errors for a bad handle."""
    if nbytes != NBYTES:
        raise ValueError(f"step channel handle says {nbytes} bytes, a step channel is {NBYTES}")
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"step channel file {path} does not exist (its owner closed it or "
                                "never created it)") from None
    if size != NBYTES:
        raise ValueError(f"{path} holds {size} bytes, a step channel is {NBYTES}: not a step channel file")
    buffer = map_file(path, NBYTES)
    if int(buffer.numpy().view(np.int64)[_MAGIC]) != MAGIC:
        raise ValueError(f"{path} is not a step channel file (no magic word)")
    return buffer, os.open(path, os.O_RDWR)


def _check_owner_alive(fd: int, path: Path, owner_pid: int) -> None:
    if not owner_alive(fd):
        raise PeerGone(f"step channel owner pid {owner_pid} is gone ({path} is no longer locked)")


def _truncate_utf8(text: str, limit: int) -> bytes:
    """At most `limit` bytes of text's utf-8, cut at a character boundary."""
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore").encode("utf-8")


def _warn_if_not_x86() -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.warning("step channel on %s: its word ordering assumes x86-64's total store order",
                       platform.machine())

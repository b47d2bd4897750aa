"""StreamFlagPair: the step channel's GPU ordering by stream memory operations on two shared words.

The same four verbs as `foundation.cuda_ipc_events.IpcEventPair` (the caller marks its inputs
written, the server's stream waits for them, and back), over a different mechanism: two 32-bit
words in one small CUDA buffer both processes map by CUDA IPC. Marking is `cuStreamWriteValue32`
(the call's sequence number, written by the GPU once the stream's earlier work is done, with a
memory barrier so that work's writes are visible first); waiting is `cuStreamWaitValue32` (the
stream holds until the word reaches the sequence number; a cyclic >= comparison, so wrapping past
2**32 is harmless). Nothing is recorded or queried on the host, so neither side blocks: the IPC
events' record cost 10-80 us on the host whenever the other process held the event open, and a
back-to-back no-op call took 277 us with them against 6 without
(`python -m bench.bench_step_channel --device cuda`, by ordering).

Why the sequence number: a word only grows, so a wait enqueued for call s passes once call s or
any later one has been marked; an abandoned call (the caller timed out and sent a newer one) can
never leave a stream waiting for a mark that will not come.

A server that dies between queueing its mark and the GPU running it could leave the caller's stream
waiting on a word nobody will write; the caller calls `release(seq)` when it learns its peer is
gone (a side stream writes the word, so the waiting stream goes on). On the H200 a SIGKILLed
server's queued mark still landed, `release` disabled or not (so a GPU test of it could not fail and
was dropped); this covers drivers that drop a dead context's queued work.

The driver entry points come from libcuda by ctypes (torch does not wrap them). `supported()`
says whether this process can use them; the step channel falls back to the events where not.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass

import torch

from foundation.cuda_ipc import CudaIpcHandle, attach_buffer, export_buffer, indexed_cuda_device

logger = logging.getLogger(__name__)

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32_t)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: with a memory barrier before the write
_INPUTS, _OUTPUTS = 0, 32  # int32 word indices, 128 bytes apart (separate cache lines)
_WORDS = 64
_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class StreamFlagPairHandle:
    """What the server needs: the flags buffer's CUDA IPC handle (which names the GPU by UUID)."""

    flags: CudaIpcHandle


class _Driver:
    """The two stream memory operations of libcuda, with their CUresult checked."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._bound = threading.local()
        self.write = self._entry("cuStreamWriteValue32")
        self.wait = self._entry("cuStreamWaitValue32")

    def _entry(self, name: str):
        function = getattr(self.lib, name + "_v2", None) or getattr(self.lib, name)
        function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        function.restype = ctypes.c_int
        return function

    def bind_context(self, device: torch.device) -> None:
        """The driver calls act on the calling thread's current context: a thread that has not yet
        made a CUDA runtime call has none, so make one (the runtime binds the primary context).
        Checked once per thread: the step's calls come from one or two threads, again and again."""
        if getattr(self._bound, "done", False):
            return
        context = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            torch.cuda.synchronize(device)
        self._bound.done = True

    def check(self, result: int, what: str) -> None:
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(message))
            text = message.value.decode() if message.value else "unknown error"
            raise RuntimeError(f"{what} failed: CUDA driver error {result} ({text})")


@functools.cache
def _driver() -> _Driver | None:
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as error:
        logger.info("no stream memory operations in libcuda (%s)", error)
        return None


@functools.cache
def supported(index: int) -> bool:
    """Whether stream memory operations work on CUDA device `index` here: one write and one wait on
    a side stream, synchronised (a driver that refuses them, or none at all, says False)."""
    driver = _driver()
    if driver is None:
        return False
    try:
        with torch.cuda.device(index):
            word = torch.zeros(1, dtype=torch.int32, device=f"cuda:{index}")
            stream = torch.cuda.Stream(index)
            stream.wait_stream(torch.cuda.current_stream(index))  # after the zero fill
            driver.check(driver.write(stream.cuda_stream, word.data_ptr(), 7, _WRITE_DEFAULT), "write")
            driver.check(driver.wait(stream.cuda_stream, word.data_ptr(), 7, _WAIT_GEQ), "wait")
            stream.synchronize()
            return int(word.item()) == 7
    except RuntimeError as error:
        logger.info("stream memory operations refused on cuda:%d (%s)", index, error)
        return False


class StreamFlagPair:
    """The caller's `create()`d flags or the server's `attach()`ed view; each side calls its verbs
    with the channel call's sequence number."""

    def __init__(self, device: torch.device, flags: torch.Tensor):
        self.device = device
        self.flags = flags  # the caller owns it; the server's view keeps the mapping alive
        self._driver = _driver()
        self._inputs = flags.data_ptr() + 4 * _INPUTS
        self._outputs = flags.data_ptr() + 4 * _OUTPUTS
        self._side_stream: torch.cuda.Stream | None = None

    @classmethod
    def create(cls, device: torch.device | str) -> StreamFlagPair:
        device = indexed_cuda_device(device, "stream flags")
        if not supported(device.index):
            raise RuntimeError(f"stream memory operations are not available on {device}")
        return cls(device, torch.zeros(_WORDS, dtype=torch.int32, device=device))

    def export(self) -> StreamFlagPairHandle:
        return StreamFlagPairHandle(export_buffer(self.flags))

    @classmethod
    def attach(cls, handle: StreamFlagPairHandle) -> StreamFlagPair:
        if not isinstance(handle, StreamFlagPairHandle):
            raise TypeError(f"handle must be a StreamFlagPairHandle, got {type(handle).__name__}")
        flags = attach_buffer(handle.flags)
        if not supported(flags.device.index):
            raise RuntimeError(f"stream memory operations are not available on {flags.device}")
        return cls(flags.device, flags)

    # ---- the caller's side -----------------------------------------------------------------------

    def inputs_written(self, seq: int) -> None:
        """Mark call `seq`'s inputs written, once this process's current stream gets there."""
        self._enqueue(self._driver.write, self._inputs, seq, _WRITE_DEFAULT, "marking the inputs written")

    def wait_outputs(self, seq: int) -> None:
        """Make this process's current stream wait until the server marked call `seq` (or a later one)."""
        self._enqueue(self._driver.wait, self._outputs, seq, _WAIT_GEQ, "waiting for the outputs")

    def release(self, seq: int) -> None:
        """The server is gone: mark call `seq`'s outputs from a side stream, so that a wait the dead
        server will never satisfy does not hold this process's stream forever."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        self._enqueue(self._driver.write, self._outputs, seq, _WRITE_DEFAULT, "releasing the outputs",
                      self._side_stream)

    # ---- the server's side -----------------------------------------------------------------------

    def wait_inputs(self, seq: int) -> None:
        """Make this process's current stream wait until the caller marked call `seq`'s inputs."""
        self._enqueue(self._driver.wait, self._inputs, seq, _WAIT_GEQ, "waiting for the inputs")

    def outputs_written(self, seq: int) -> None:
        """Mark call `seq`'s outputs written, once this process's current stream gets there."""
        self._enqueue(self._driver.write, self._outputs, seq, _WRITE_DEFAULT, "marking the outputs written")

    # ----------------------------------------------------------------------------------------------

    def _enqueue(self, operation, address: int, seq: int, flags: int, what: str,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Queue one stream memory operation (the driver's write or wait) of seq on `stream`
        (default: this process's current stream)."""
        stream = stream or torch.cuda.current_stream(self.device)
        self._driver.bind_context(self.device)
        self._driver.check(operation(stream.cuda_stream, address, seq & _MASK, flags), what)

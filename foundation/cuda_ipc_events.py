"""IpcEventPair: two CUDA IPC events that order one process's GPU work before another's, no host sync.

A step channel's signal (`foundation.step_channel`) says on the host that the other side may go on;
it says nothing about the GPU. When the step buffers are CUDA memory, the caller's kernels that
write the inputs may still be queued when the server's kernels start reading them, and the same for
the drafts on the way back. `torch.cuda.synchronize()` on each side would order them at the cost of
draining both queues every call; two interprocess events order only what must be ordered:

    caller:  write inputs (its stream) -> record inputs_ready -> signal the request
    server:  see the request -> its stream waits on inputs_ready -> run the handler (its stream)
             -> record outputs_ready -> signal the answer
    caller:  see the answer -> its stream waits on outputs_ready -> read the outputs (its stream)

This is the pattern torch itself uses to share CUDA tensors (the producer records an IPC event
before sending the handle, the consumer's stream waits on it). Why it holds across processes:
`cudaStreamWaitEvent` waits for the record that was the event's latest when it is called, and the
host signal orders the caller's `cudaEventRecord` call before the server's wait call. Re-recording
the event for the next step does not disturb a wait already enqueued.

Contract:
- The caller (the channel's owner) creates both events and must keep them alive while the server
  holds its copies (CUDA: using an imported event after its exporter destroyed it is undefined).
- "Its stream" is the current stream of the events' device in each process when the channel is
  called: the caller writes its inputs on (or orders them before) that stream, the server's handler
  launches on that stream (CUDA graph replays included), and the caller reads the outputs on it.
  Because the caller's stream waits on outputs_ready, its next writes to the inputs also come after
  the server's kernels have read them (no write-after-read race on the reused buffers).
- Events are per GPU; the handle names the GPU by UUID, so the server finds it whatever its
  CUDA_VISIBLE_DEVICES numbering (`foundation.cuda_ipc.local_device_index`).
- The server must be another process: CUDA cannot open an IPC handle in the process that exported
  it ("invalid device context"), so a CUDA channel cannot be served from the owner's own process.

Cost (H200 host, torch 2.11; `python -m bench.bench_step_channel --device cuda --ordering events`):
a record or wait takes ~2.5 us while one process uses the event, but with the other process holding
it open a record took 10-80 us, as if it waited for the GPU to pass the event's previous record and
waits. A no-op call measured p50 67 us with the events against 22 us without after a 200 us idle
gap, 172 against 55 after 2 ms, and 277 against 6 back to back. A host `synchronize` on both sides
instead measured worse (350-490 us with one tiny kernel a side). Stream memory operations
(cuStreamWriteValue32 / cuStreamWaitValue32 on host-mapped memory) avoid both:
`foundation.cuda_stream_flags`, which the channel takes wherever the driver offers them
(`foundation.gpu_ordering`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.cuda_ipc import gpu_uuid, indexed_cuda_device, local_device_index


@dataclass(frozen=True)
class IpcEventPairHandle:
    """What the server needs to open the pair: the GPU's UUID and the two events' IPC handles."""

    gpu_uuid: str
    inputs_ready: bytes
    outputs_ready: bytes


class IpcEventPair:
    """The caller's `create()`d pair or the server's `attach()`ed copy; each side calls its two verbs.
    They take the channel call's sequence number as `foundation.cuda_stream_flags`' verbs do, and
    ignore it: an event's wait is for its latest record, whatever the call."""

    def __init__(self, device: torch.device, inputs_ready: torch.cuda.Event, outputs_ready: torch.cuda.Event):
        self.device = device
        self.inputs_ready = inputs_ready
        self.outputs_ready = outputs_ready

    @classmethod
    def create(cls, device: torch.device | str) -> IpcEventPair:
        """Two interprocess events on `device` (a CUDA device); timing is off, as IPC events require."""
        device = indexed_cuda_device(device, "CUDA IPC events")
        with torch.cuda.device(device):
            events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                      for _ in range(2)]
            # torch creates a CUDA event lazily; recording it here creates it on `device`, and a
            # wait before the first real record returns at once
            for event in events:
                event.record(torch.cuda.current_stream(device))
        return cls(device, *events)

    def export(self) -> IpcEventPairHandle:
        return IpcEventPairHandle(gpu_uuid(self.device.index), self.inputs_ready.ipc_handle(),
                                  self.outputs_ready.ipc_handle())

    @classmethod
    def attach(cls, handle: IpcEventPairHandle) -> IpcEventPair:
        """Open the caller's events in this (another) process, on its index of the same GPU."""
        if not isinstance(handle, IpcEventPairHandle):
            raise TypeError(f"handle must be an IpcEventPairHandle, got {type(handle).__name__}")
        device = torch.device("cuda", local_device_index(handle.gpu_uuid))
        return cls(device, torch.cuda.Event.from_ipc_handle(device, handle.inputs_ready),
                   torch.cuda.Event.from_ipc_handle(device, handle.outputs_ready))

    # ---- the caller's side -----------------------------------------------------------------------

    def inputs_written(self, seq: int) -> None:
        """Mark the end of the inputs' writes on this process's current stream (before the request)."""
        self.inputs_ready.record(torch.cuda.current_stream(self.device))

    def wait_outputs(self, seq: int) -> None:
        """Make this process's current stream wait for the server's outputs (after the answer)."""
        torch.cuda.current_stream(self.device).wait_event(self.outputs_ready)

    # ---- the server's side -----------------------------------------------------------------------

    def wait_inputs(self, seq: int) -> None:
        """Make this process's current stream wait for the caller's inputs (before the handler)."""
        torch.cuda.current_stream(self.device).wait_event(self.inputs_ready)

    def outputs_written(self, seq: int) -> None:
        """Mark the end of the handler's work on this process's current stream (before the answer)."""
        self.outputs_ready.record(torch.cuda.current_stream(self.device))

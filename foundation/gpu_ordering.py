"""Which mechanism orders the caller's and the server's GPU work on a step channel.

Both offer the same four verbs with the call's seq (`inputs_written`, `wait_inputs`,
`outputs_written`, `wait_outputs`; `foundation.step_channel` says who calls which):
- "flags" (`foundation.cuda_stream_flags`): stream memory operations on two words both processes
  map; nothing blocks on the host. The split's B 1 step measured 0.973-0.976 of the in-process
  engine's tokens/s with them in two runs (bench/results/services_split_h200_flags5.md is one).
- "events" (`foundation.cuda_ipc_events`): a pair of CUDA IPC events, whose host-side records cost
  10-80 us each while the other process holds them open (0.934 in the same runs).
"auto", the default, takes the flags wherever the driver offers stream memory operations and the
events elsewhere. The environment variable DFLASH_CHANNEL_ORDERING ("flags" or "events") overrides
"auto", so a benchmark can time both through services that create their own channels.
"""

from __future__ import annotations

import logging
import os

import torch

from foundation.cuda_ipc import indexed_cuda_device
from foundation.cuda_ipc_events import IpcEventPair, IpcEventPairHandle
from foundation.cuda_stream_flags import StreamFlagPair, StreamFlagPairHandle, supported

logger = logging.getLogger(__name__)

ORDERINGS = ("auto", "flags", "events")
GpuOrdering = IpcEventPair | StreamFlagPair
GpuOrderingHandle = IpcEventPairHandle | StreamFlagPairHandle


def check_ordering(ordering: str, name: str = "ordering") -> None:
    if ordering not in ORDERINGS:
        raise ValueError(f"{name} must be one of {ORDERINGS}, got {ordering!r}")


def create_ordering(device: torch.device, ordering: str) -> GpuOrdering:
    """The GPU ordering `ordering` names on `device` ("auto": the environment's choice, else flags
    where the driver offers stream memory operations, else events)."""
    check_ordering(ordering)
    if ordering == "auto":
        ordering = os.environ.get("DFLASH_CHANNEL_ORDERING", "auto")
        check_ordering(ordering, "DFLASH_CHANNEL_ORDERING")
    if ordering == "auto":
        ordering = "flags" if supported(indexed_cuda_device(device, "step buffers").index) else "events"
    pair = StreamFlagPair.create(device) if ordering == "flags" else IpcEventPair.create(device)
    logger.info("step channel GPU ordering: %s", ordering)
    return pair


def attach_ordering(handle: GpuOrderingHandle | None) -> GpuOrdering | None:
    if handle is None:
        return None
    if isinstance(handle, StreamFlagPairHandle):
        return StreamFlagPair.attach(handle)
    return IpcEventPair.attach(handle)

"""Programmatic dependent launch (PDL) for the attention kernels on Hopper and later GPUs.

A kernel launched with PDL may start while the kernel before it in the stream is still
finishing: its programs are scheduled early and wait at ``griddepcontrol.wait`` until the previous
grid has completed and its writes are visible. That hides the launch gap between dependent
kernels (the split and merge kernels of split-KV, or attention after the projection that wrote its
queries): measured 0.5-1.7 us per call at small batches on an H200, where a call takes 10-30 us
(the latency ablation's result, in git history).

Rule for kernels: call `wait_for_previous_grid` before the first load of any input and the first
store of any output (only index arithmetic may run before it), and `allow_next_grid` once the
heavy work is done, to let the next PDL kernel be scheduled once every program of this grid has
called it or exited (its programs then hold SM slots while they wait for this grid to end). With
USE_PDL false both compile to nothing; the interpreter and GPUs before sm_90 always get false.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # a Triton without grid dependency control: PDL stays off
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@functools.cache
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: a CUDA GPU of compute capability >= 9.0 and a Triton
    that has grid dependency control (never the interpreter, which runs on CPU tensors).

    No switch turns it off elsewhere: it changes no result, only the launch gaps
    (tests/unit/kernels/test_pdl.py compares both on one GPU).
    """
    if device.type != "cuda" or not HAS_GDC:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports_pdl(index)


@triton.jit
def wait_for_previous_grid(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def allow_next_grid(USE_PDL: tl.constexpr):
    """Let the next PDL kernel in the stream be scheduled (it still waits for this grid to end)."""
    if USE_PDL:
        gdc_launch_dependents()

"""StreamFlagPair in one process (GPU): a stream waiting for a mark holds its later work until the
mark, an older mark does not pass it, and `release` frees a stream whose mark will never come; on
any machine, both orderings refuse what is not theirs in one line.

(Across processes the step channel's GPU tests cover it:
tests/multiprocess/test_step_channel_gpu_ordering.py.)
"""

import random
import time

import pytest
import torch

from foundation.cuda_ipc_events import IpcEventPair
from foundation.cuda_stream_flags import StreamFlagPair


def _held(stream: torch.cuda.Stream, seconds: float = 0.05) -> bool:
    """True if the stream's queued work is still not done after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if stream.query():
            return False
        time.sleep(1e-3)
    return True


@pytest.mark.gpu
def test_a_wait_holds_until_the_mark_of_its_call_or_a_later_one():
    pair = StreamFlagPair.create("cuda")
    seq = random.randrange(1, 2**31)
    waiter, marker = torch.cuda.Stream(), torch.cuda.Stream()
    out = torch.zeros(1, device="cuda")
    with torch.cuda.stream(waiter):
        pair.wait_outputs(seq + 1)
        out.fill_(1.0)
    with torch.cuda.stream(marker):
        pair.outputs_written(seq)  # an older call's mark: the waiter stays held
    marker.synchronize()
    assert _held(waiter) and out.item() == 0.0  # item() runs on the default stream, not the held one
    with torch.cuda.stream(marker):
        pair.outputs_written(seq + 2)  # a later call's mark passes it (>=)
    waiter.synchronize()
    assert out.item() == 1.0


@pytest.mark.gpu
def test_release_frees_a_stream_whose_server_never_marks():
    pair = StreamFlagPair.create("cuda")
    seq = random.randrange(1, 2**31)
    waiter = torch.cuda.Stream()
    with torch.cuda.stream(waiter):
        pair.wait_outputs(seq)
    assert _held(waiter)
    pair.release(seq)
    waiter.synchronize()  # returns: the side stream wrote the word


@pytest.mark.gpu
def test_marks_wrap_past_two_to_the_32():
    pair = StreamFlagPair.create("cuda")
    waiter, marker = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(marker):
        pair.inputs_written(2**32 - 1)
    marker.synchronize()
    with torch.cuda.stream(waiter):
        pair.wait_inputs(2**32 + 3)  # word 3 after the wrap: not yet reached although 3 < 2**32 - 1
    assert _held(waiter)
    with torch.cuda.stream(marker):
        pair.inputs_written(2**32 + 3)
    waiter.synchronize()


@pytest.mark.parametrize("pair, what", [(StreamFlagPair, "stream flags"), (IpcEventPair, "CUDA IPC events")])
def test_either_ordering_refuses_a_cpu_device_by_name(pair, what):
    with pytest.raises(ValueError, match=f"^{what} live on a CUDA device, got 'cpu'$"):
        pair.create("cpu")


def test_attaching_flags_wants_their_handle():
    with pytest.raises(TypeError, match="handle must be a StreamFlagPairHandle, got str"):
        StreamFlagPair.attach("not a handle")

"""The step channel's GPU ordering seen through the channel: on a GPU, stream flags and IPC events
order the caller's and the server's work both ways, also for a successor server; on any machine,
the seq each call hands its ordering, the release of a call a dead server leaves, and the names.
"""

import os
import signal

import pytest
import torch
from step_channel_servers import ADD, Served, affine_late_calls

from foundation.step_channel import PeerGone, StepChannel


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("ordering", ["flags", "events"])
def test_the_gpu_ordering_orders_the_callers_writes_before_the_servers_kernels_and_back(ordering):
    """Both sides queue their writes behind a GPU sleep and never synchronise the host: only the
    channel's GPU ordering (stream flags or IPC events) can make the server read this step's x and
    this process read this step's y."""
    served = Served("cuda", ordering)
    try:
        assert type(served.channel.ordering).__name__ == {"flags": "StreamFlagPair",
                                                          "events": "IpcEventPair"}[ordering]
        served.start_server()
        affine_late_calls(served, 10)
    finally:
        served.close()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("ordering", ["flags", "events"])
def test_a_successor_server_keeps_the_gpu_ordering_after_the_first_is_killed(ordering):
    """The successor opens the caller's flags (or events) afresh and the calls' seqs go on from where
    the dead server left them: its GPU work is still ordered both ways."""
    served = Served("cuda", ordering)
    try:
        first = served.start_server()
        affine_late_calls(served, 3)
        os.kill(first.pid, signal.SIGKILL)
        first.join(30)
        with pytest.raises(PeerGone):
            served.channel.call(ADD)
        served.start_server(after_epoch=1)
        affine_late_calls(served, 10)
    finally:
        served.close()


class RecordedOrdering:
    """Stands in for the GPU ordering on the caller's side and records what the channel asks of it."""

    def __init__(self):
        self.calls = []

    def inputs_written(self, seq):
        self.calls.append(("inputs_written", seq))

    def wait_outputs(self, seq):
        self.calls.append(("wait_outputs", seq))

    def release(self, seq):
        self.calls.append(("release", seq))


@pytest.mark.slow
def test_the_caller_marks_and_waits_with_each_calls_seq_and_releases_a_dead_servers_call(served):
    """The seq the ordering gets is the call's own (the flags compare it), answered calls are waited
    on, and a call the server died on is released (its mark may never come)."""
    channel, recorded = served.channel, RecordedOrdering()
    channel.ordering = recorded  # the server attached without one: only the caller's side is recorded
    calls = int(torch.randint(2, 6, ()))
    for _ in range(calls):
        channel.call(ADD, 1)
    first = recorded.calls[0][1]
    assert recorded.calls == [(verb, first + i) for i in range(calls)
                              for verb in ("inputs_written", "wait_outputs")]
    recorded.calls.clear()
    os.kill(served.processes[0].pid, signal.SIGKILL)
    served.processes[0].join(30)
    with pytest.raises(PeerGone):
        channel.call(ADD, 1)
    assert recorded.calls == [("inputs_written", first + calls), ("release", first + calls)]
    channel.ordering = None


def test_an_unknown_gpu_ordering_is_refused_with_the_choices():
    choices = r"\('auto', 'flags', 'events'\)"
    with pytest.raises(ValueError, match=rf"ordering must be one of {choices}, got 'fences'"):
        StepChannel.create(ordering="fences")

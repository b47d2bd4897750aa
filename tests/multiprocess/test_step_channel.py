"""StepChannel between two processes: answers match a local reference, errors come back as text, a
killed server is noticed promptly, its successor resumes, and bad handles fail in one line.

The server runs in a spawned process (as a Ray actor would: no inherited pipe, only the pickled
handle); its handler computes things this process checks (`step_channel_servers`). The GPU
ordering's tests are in test_step_channel_gpu_ordering.py.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest
import torch
from step_channel_servers import ADD, AFFINE, FAIL, PID, SLEEP, SLEEP_RESULT, N

from foundation.step_channel import (
    MAX_ARGS,
    MESSAGE_BYTES,
    NBYTES,
    PeerGone,
    RemoteError,
    StepChannel,
    StepChannelHandle,
)


@pytest.mark.slow
def test_opcodes_and_args_reach_the_server_and_its_answers_match_a_local_reference(served):
    channel = served.channel
    assert channel.call(PID) == served.processes[0].pid == channel.server_pid
    assert channel.epoch == 1 and channel.caller_pid == os.getpid()
    for _ in range(300):
        args = torch.randint(-2**40, 2**40, (int(torch.randint(0, MAX_ARGS + 1, ())),)).tolist()
        assert channel.call(ADD, *args) == sum(args)
    for _ in range(100):  # data through shared memory, counts through the channel
        n, a, b = int(torch.randint(1, N + 1, ())), *torch.randint(-1000, 1000, (2,)).tolist()
        x = torch.randint(-10**6, 10**6, (n,))
        served.x[:n] = x
        total = channel.call(AFFINE, n, a, b)
        assert torch.equal(served.y[:n], x * a + b) and total == int((x * a + b).sum())


@pytest.mark.slow
def test_a_handler_error_arrives_as_remote_error_text_and_the_channel_keeps_serving(served):
    channel = served.channel
    value = int(torch.randint(0, 10**6, ()))
    with pytest.raises(RemoteError, match=f"opcode {FAIL}: ValueError: refused {value} é") as error:
        channel.call(FAIL, value, 1000)  # 2000 bytes of message: cut to the text area, whole characters
    text = str(error.value).split(": ", 1)[1]
    assert len(text.encode()) <= MESSAGE_BYTES and "\ufffd" not in text and text.endswith("é")
    assert f"pid {served.processes[0].pid}" in str(error.value)
    with pytest.raises(RemoteError, match="KeyError: 99"):
        channel.call(99)
    args = torch.randint(-1000, 1000, (3,)).tolist()
    assert channel.call(ADD, *args) == sum(args)


@pytest.mark.slow
def test_a_killed_server_is_peer_gone_within_a_second_and_a_new_server_resumes_the_channel(served):
    channel, first = served.channel, served.processes[0]
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(first.pid, signal.SIGKILL)

    threading.Timer(0.3, kill).start()
    with pytest.raises(PeerGone, match=f"pid {first.pid} is gone") as gone:
        channel.call(SLEEP, 60_000, timeout_s=10)  # the server dies while this call waits on it
    assert time.monotonic() - killed_at[0] < 1.0
    assert gone.value.epoch == 1 and "\n" not in str(gone.value)
    served.x[:] = torch.randint(1, 1000, (N,))
    with pytest.raises(PeerGone, match="is gone"):
        channel.call(AFFINE, N, 3, 1, timeout_s=10)  # nobody serves until a successor attaches

    second = served.start_server(after_epoch=gone.value.epoch)
    assert channel.epoch == 2 and channel.server_pid == second.pid != first.pid
    assert channel.call(PID) == second.pid
    args = torch.randint(-1000, 1000, (MAX_ARGS,)).tolist()
    assert channel.call(ADD, *args) == sum(args)
    assert not served.y.any()  # the call abandoned with PeerGone was not run by the successor


@pytest.mark.slow
def test_a_posted_call_runs_while_the_caller_goes_on_and_the_next_call_waits_for_it(served):
    channel = served.channel
    for _ in range(50):  # each posted map is done (and visible) when the next call returns
        n, a, b = int(torch.randint(1, N + 1, ())), *torch.randint(-1000, 1000, (2,)).tolist()
        x = torch.randint(-10**6, 10**6, (n,))
        served.x[:n] = x
        channel.post(AFFINE, n, a, b)
        args = torch.randint(-1000, 1000, (3,)).tolist()
        assert channel.call(ADD, *args) == sum(args)
        assert torch.equal(served.y[:n], x * a + b)
    start = time.monotonic()
    channel.post(SLEEP, 300)
    assert time.monotonic() - start < 0.2  # post did not wait for the 300 ms handler
    channel.settle()
    assert time.monotonic() - start >= 0.3
    channel.settle()  # nothing outstanding: returns at once
    value = int(torch.randint(0, 10**6, ()))
    channel.post(FAIL, value, 1)
    with pytest.raises(RemoteError, match=f"refused {value}"):
        channel.call(ADD, 1, 2)  # the posted call's error, raised by the next call (which did not run)
    assert channel.call(ADD, 1, 2) == 3  # the error was dropped with the posted call


def test_the_owner_counts_its_waiting_and_the_server_its_handler_time(served):
    """wait_s (the owner's, in calls and settles) covers the server's handler time; server_busy_s (the
    server's, read through the shared words) covers the sleeps its handler took, and not the time the
    caller spent elsewhere."""
    channel = served.channel
    sleeps = torch.randint(20, 60, (3,)).tolist()  # ms
    channel.call(SLEEP, sleeps[0])
    channel.post(SLEEP, sleeps[1])
    time.sleep(0.15)  # the caller busy elsewhere: the posted handler finishes meanwhile
    channel.settle()
    channel.call(SLEEP, sleeps[2])
    handled = sum(sleeps) / 1000
    assert handled <= channel.server_busy_s < handled + 0.1
    assert sleeps[0] / 1000 + sleeps[2] / 1000 <= channel.wait_s < handled + 0.1
    busy, waited = channel.server_busy_s, channel.wait_s
    assert channel.call(ADD, 2, 3) == 5  # a call that takes no time on either side adds little
    assert channel.server_busy_s - busy < 0.01 and channel.wait_s - waited < 0.05


@pytest.mark.slow
def test_a_posted_call_to_a_server_that_dies_is_peer_gone_once_then_a_successor_serves(served):
    channel, first = served.channel, served.processes[0]
    channel.post(SLEEP, 60_000)
    os.kill(first.pid, signal.SIGKILL)
    with pytest.raises(PeerGone, match=f"pid {first.pid} is gone"):
        channel.settle()
    second = served.start_server(after_epoch=1)
    assert channel.call(PID) == second.pid  # the abandoned post is not raised again


@pytest.mark.slow
def test_a_call_times_out_and_the_late_answer_is_not_taken_for_the_next_call(served):
    channel = served.channel
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"did not answer opcode {SLEEP} within 0.2 s"):
        channel.call(SLEEP, 800, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 0.7
    args = torch.randint(-1000, 1000, (2,)).tolist()
    assert channel.call(ADD, *args) == sum(args) != SLEEP_RESULT  # served after the sleep ends


def test_without_a_server_a_call_is_peer_gone_at_once_and_waiting_times_out():
    channel = StepChannel.create()
    try:
        start = time.monotonic()
        with pytest.raises(PeerGone, match="no server has attached"):
            channel.call(ADD, 1)
        with pytest.raises(TimeoutError, match="no server attached"):
            channel.wait_for_server(0.05)
        assert time.monotonic() - start < 0.5
    finally:
        channel.close()


def test_one_live_server_at_a_time_and_each_attach_bumps_the_epoch():
    channel = StepChannel.create()
    handle = pickle.loads(pickle.dumps(channel.export()))
    assert handle == channel.export() and handle.ordering is None and handle.nbytes == NBYTES
    first = StepChannel.attach(handle)
    try:
        with pytest.raises(RuntimeError, match=f"already has a live server \\(pid {os.getpid()}\\)"):
            StepChannel.attach(handle)
        assert channel.epoch == 1
        first.close()
        assert channel.server_pid == 0
        second = StepChannel.attach(handle)
        assert channel.epoch == 2 and channel.wait_for_server(1, after_epoch=1) == 2
        second.close()
    finally:
        channel.close()


def test_a_server_whose_owner_closed_is_peer_gone_instead_of_waiting():
    channel = StepChannel.create()
    server = StepChannel.attach(channel.export())
    owner_pid = channel.caller_pid
    channel.close()
    start = time.monotonic()
    with pytest.raises(PeerGone, match=f"owner pid {owner_pid} is gone"):
        server.serve_one(lambda opcode, args: 0, timeout_s=5)
    assert time.monotonic() - start < 0.5
    server.close()
    with pytest.raises(FileNotFoundError):
        StepChannel.attach(StepChannelHandle(str(channel.path), NBYTES))


def test_bad_handles_fail_with_one_line_that_names_the_problem(tmp_path):
    cases = [
        (StepChannelHandle("/dev/shm/dflash-channel-missing-0", NBYTES), FileNotFoundError, "does not exist"),
        (StepChannelHandle(str(tmp_path / "channel"), NBYTES - 8), ValueError, f"a step channel is {NBYTES}"),
        (StepChannelHandle(str(tmp_path / "short"), NBYTES), ValueError, "holds 100 bytes"),
        (StepChannelHandle(str(tmp_path / "zeros"), NBYTES), ValueError, "not a step channel file"),
        ("/dev/shm/some-file", TypeError, "must be a StepChannelHandle"),
    ]
    (tmp_path / "short").write_bytes(b"\0" * 100)
    (tmp_path / "zeros").write_bytes(b"\0" * NBYTES)
    for handle, kind, words in cases:
        with pytest.raises(kind, match=words) as error:
            StepChannel.attach(handle)
        assert "\n" not in str(error.value)


def test_calls_refuse_what_the_words_cannot_carry():
    channel = StepChannel.create()
    server = StepChannel.attach(channel.export())
    try:
        with pytest.raises(ValueError, match=f"at most {MAX_ARGS} ints"):
            channel.call(ADD, *range(MAX_ARGS + 1))
        with pytest.raises(ValueError, match="must fit int64"):
            channel.call(ADD, 2**63)
        with pytest.raises(RuntimeError, match="attached side serves"):
            server.call(ADD)
        with pytest.raises(RuntimeError, match="serve from the attached side"):
            channel.serve_one(lambda opcode, args: 0, timeout_s=0)
    finally:
        server.close()
        channel.close()

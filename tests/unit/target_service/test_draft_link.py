"""DrafterLink alone: a dead drafter turns into DrafterUnavailable (never an error the engine cannot
take), one re-attach is asked for at once, polled without waiting, retried after a failure, and the
link serves again once it succeeds."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from drafter_service.control import DrafterUnavailable
from foundation.step_channel import PeerGone, RemoteError
from target_service.assembly import draft_link
from target_service.assembly.draft_link import DrafterLink


class FlakyControl:
    """A ChannelDraftControl double: records calls, raises what it is told to next."""

    block_size = 8

    def __init__(self):
        self.calls, self.fail_with = [], None

    def _call(self, name, *args):
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        self.calls.append((name, *args))

    def store_context(self, num_rows):
        self._call("store_context", num_rows)

    def settle(self):
        self._call("settle")

    def propose(self, num_seqs, num_draft, num_block_cols):
        self._call("propose", num_seqs, num_draft, num_block_cols)


class Reattacher:
    def __init__(self):
        self.futures: list[Future] = []

    def __call__(self) -> Future:
        self.futures.append(Future())
        return self.futures[-1]


def test_a_dead_drafter_is_unavailable_until_a_reattach_succeeds():
    control, reattach, clock = FlakyControl(), Reattacher(), [100.0]
    link = DrafterLink(control, reattach, block_size=8, clock=lambda: clock[0])
    link.propose(2, 7, 3)
    assert control.calls == [("propose", 2, 7, 3)] and link.available

    control.fail_with = PeerGone("step channel server pid 7 is gone")
    with pytest.raises(DrafterUnavailable, match="pid 7 is gone"):
        link.store_context(5)
    assert not link.available and link.num_failures == 1 and len(reattach.futures) == 1

    with pytest.raises(DrafterUnavailable, match="restarting"):  # not done yet: no call, no wait
        link.propose(1, 7, 1)
    assert len(control.calls) == 1

    reattach.futures[0].set_exception(RuntimeError("the actor is restarting"))
    with pytest.raises(DrafterUnavailable):  # the failed attach is dropped, retried later
        link.settle()
    assert len(reattach.futures) == 1
    with pytest.raises(DrafterUnavailable):  # too soon to ask again
        link.settle()
    clock[0] += draft_link.RETRY_AFTER_S + 0.01
    with pytest.raises(DrafterUnavailable):  # asked again, not done yet
        link.settle()
    assert len(reattach.futures) == 2

    reattach.futures[1].set_result(1234)
    link.propose(3, 7, 2)
    assert link.available and link.num_reattached == 1 and control.calls[-1] == ("propose", 3, 7, 2)


def test_a_drafter_that_times_out_is_unavailable_but_its_own_errors_propagate():
    control, reattach = FlakyControl(), Reattacher()
    link = DrafterLink(control, reattach, block_size=8)
    control.fail_with = TimeoutError("did not answer opcode 3 within 120 s")
    with pytest.raises(DrafterUnavailable, match="within 120 s"):
        link.propose(1, 7, 1)
    reattach.futures[0].set_result(1)
    control.fail_with = RemoteError("opcode 3: IndexError: a bug in the drafter")
    with pytest.raises(RemoteError, match="a bug in the drafter"):  # a bug is not a dead process
        link.propose(1, 7, 1)
    assert link.available and link.num_failures == 1

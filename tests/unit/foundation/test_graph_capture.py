"""collector_held: garbage from before is collected on entry, none is collected inside (however many
allocations pass the collector's threshold), and the collector is restored after, an exception
included. On a GPU, the cause it removes: an old CUDAGraph freed by the collector during a capture
invalidates that capture; under collector_held the same capture succeeds."""

import gc
import random
from typing import ClassVar

import pytest
import torch

from foundation.graph_capture import collector_held


class Finalized:
    """Part of a reference cycle (only the collector frees it) that records when it is freed."""

    freed: ClassVar[list[int]] = []

    def __init__(self, tag: int, payload=None):
        self.tag, self.payload, self.me = tag, payload, self

    def __del__(self):
        Finalized.freed.append(self.tag)


@pytest.fixture
def low_threshold():
    """The collector runs after every few allocations, as under a busy capture."""
    before = gc.get_threshold()
    gc.set_threshold(5, 1, 1)
    Finalized.freed.clear()
    yield
    gc.set_threshold(*before)


def churn(n: int) -> list:
    return [[i] for i in range(n)]


def test_garbage_from_before_goes_on_entry_and_none_inside(low_threshold):
    before, inside = random.randrange(1000), random.randrange(1000, 2000)
    Finalized(before)
    with collector_held():
        assert Finalized.freed == [before]
        Finalized(inside)
        churn(10_000)
        assert Finalized.freed == [before]
    gc.collect()
    assert Finalized.freed == [before, inside]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_restored_as_it_was_even_after_an_error(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(KeyError), collector_held():
            assert not gc.isenabled()
            raise KeyError("inside")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def _old_graph_in_a_cycle() -> list:
    """A captured graph held by a reference cycle, itself held by the list returned: clearing the
    list makes the graph garbage that only the collector frees."""
    x = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return [Finalized(0, payload=graph)]


def _capture_with_churn(release) -> None:
    """A capture during which the old graph becomes garbage and host allocations go on, as an engine's
    capture does while an earlier engine's graphs wait for the collector."""
    y = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        release()
        for _ in range(50):
            churn(200)
            y.mul_(2)
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_an_old_graph_collected_mid_capture_breaks_it_and_collector_held_prevents_it(low_threshold):
    with pytest.raises(RuntimeError, match="capture"):
        _capture_with_churn(_old_graph_in_a_cycle().clear)
    assert 0 in Finalized.freed  # the collector ran inside the capture: that broke it
    torch.cuda.synchronize()
    Finalized.freed.clear()
    with collector_held():
        _capture_with_churn(_old_graph_in_a_cycle().clear)
        assert Finalized.freed == []
    gc.collect()
    assert Finalized.freed == [0]

"""LoadProgress: a bar only on a terminal and only for a slow load; tenths at DEBUG, one INFO line."""

from __future__ import annotations

import io
import logging

import pytest

from foundation.weights import LoadProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def load(stream: io.StringIO, *, delay: float, enabled: bool = True) -> str:
    meter = LoadProgress("loading ckpt", 1000, 4, enabled, stream=stream, delay=delay)
    for _ in range(4):
        meter.advance(250)
    meter.finish()
    return stream.getvalue()


def test_a_slow_load_on_a_terminal_shows_a_bar():
    assert "loading ckpt" in load(Terminal(), delay=0.0)  # delay 0: every load counts as slow


@pytest.mark.parametrize("stream, delay, enabled", [
    (io.StringIO(), 0.0, True),  # not a terminal (a pipe, a log file): no bar
    (Terminal(), 60.0, True),  # a load faster than the delay: no bar
    (Terminal(), 0.0, False),  # switched off
])
def test_no_bar_off_a_terminal_for_a_fast_load_or_when_off(stream, delay, enabled):
    assert load(stream, delay=delay, enabled=enabled) == ""


def test_tenths_at_debug_and_one_info_line_at_the_end(caplog):
    with caplog.at_level(logging.DEBUG, logger="foundation.weights"):
        load(io.StringIO(), delay=0.0)
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records[:4] == [(logging.DEBUG, f"loading ckpt: {p}% ({n}/4 tensors)")
                           for n, p in ((1, 20), (2, 50), (3, 70), (4, 100))]
    assert len(records) == 5 and records[4][0] == logging.INFO
    assert records[4][1].startswith("loading ckpt: 4 tensors, 1000 elements in ")

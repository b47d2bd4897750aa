"""What a command printed to stderr, less the start-up sweep's reports.

Any command that makes a CPU pool first removes the shared-memory files of dead owners and says so on
stderr (`foundation.shm.sweep_stale_files`). Fault tests running beside the CLI tests kill pools with
SIGKILL, so such a line may come before any command's own one-line error: the tests that demand that
one line read stderr through `without_sweep_reports`.
"""
from __future__ import annotations

import re

SWEEP_REPORT = re.compile(r"^WARNING foundation\.shm: removed \S+, left behind by a dead owner$")


def without_sweep_reports(err: str) -> str:
    """`err` without the lines that report a removed file of a dead owner."""
    lines = err.splitlines(keepends=True)
    return "".join(line for line in lines if not SWEEP_REPORT.match(line.rstrip("\n")))

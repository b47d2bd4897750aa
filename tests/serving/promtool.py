"""A Prometheus exposition checked twice: parsed back (every family typed and helped, no series twice,
histograms cumulative up to +Inf = count), then by Prometheus's own `promtool check metrics`.

promtool is a Go binary outside the project's dependencies: set PROMTOOL to it, or put it on PATH
(Debian's `prometheus` package holds it: `apt-get download prometheus && dpkg -x prometheus_*.deb d`,
then `d/usr/bin/promtool`). Without it the parse still runs and the test is skipped after it, saying so.

promtool lints what vLLM's own names do (every name holds ':', the histogram
`vllm:iteration_tokens_total` ends in `_total`): `check_metrics` allows those findings, and only those.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

VLLM_LINTS = ("metric names should not contain ':'",)
VLLM_HISTOGRAM_TOTAL = ('vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix',)


def promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


def parse_checks(text: str) -> None:
    lines = text.splitlines()
    seen = set()
    for family in text_string_to_metric_families(text):
        exposed = family.name + ("_total" if family.type == "counter" else "")
        assert f"# TYPE {exposed} {family.type}" in lines, family.name
        assert any(line.startswith(f"# HELP {exposed} ") for line in lines), family.name
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in seen, f"{sample.name}{sample.labels} twice"
            seen.add(key)
        if family.type == "histogram":
            series = collections.defaultdict(lambda: collections.defaultdict(list))
            for sample in family.samples:
                labels = frozenset((k, v) for k, v in sample.labels.items() if k != "le")
                series[labels][sample.name.removeprefix(family.name)].append(sample)
            for parts in series.values():
                buckets = sorted(parts["_bucket"], key=lambda s: float(s.labels["le"]))
                counts = [s.value for s in buckets]
                assert counts == sorted(counts) and math.isinf(float(buckets[-1].labels["le"])), family.name
                assert counts[-1] == parts["_count"][0].value, family.name


def check_metrics(text: str) -> None:
    """Parse `text` back, then run promtool on it (skip, after the parse, where there is none)."""
    parse_checks(text)
    binary = promtool()
    if binary is None:
        pytest.skip("promtool not found (PROMTOOL or PATH): the exposition was only parsed back")
    result = subprocess.run([binary, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode in (0, 3), result.stderr  # 1: it could not parse; 3: lint findings only
    findings = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    wrong = [line for line in findings
             if not line.endswith(VLLM_LINTS) and line not in VLLM_HISTOGRAM_TOTAL]
    assert not wrong, "promtool found:\n" + "\n".join(wrong)

"""fp8 operand paths, checked in an offline sm_90 build (bench/bench_kernel_sass.py, no GPU needed).

Without `kernels.operands.widen_values`' inline-asm step Triton reads an fp8 value tile from shared
memory one byte at a time (`LDS.U8`) in a 16-row decode tile; with it the tile reaches the MMA through
a 16-bit transposing ldmatrix (`LDSM.16.MT88`). Building both ways in a subprocess (the interpreter
that the CPU tests use cannot compile) shows the step doing its job on the Triton the CI installs;
the codegen of other Triton versions may differ, so the check runs on the pinned one only.

The e4m3 score dot (`kernels.operands.quantizes_q`, on Hopper for fp8 caches) of a 64-row tile must
reach the Hopper MMA in e4m3 (QGMMA, for q's two terms) with the keys as stored, so only the values
are widened; an fp8 dot that Triton lowered by widening both operands again would keep the cost and lose
nothing visible in the outputs.

The stage counts the launchers take (`paged_tiles.DOUBLE_BUFFER_STAGES`, the context kernel's 5)
rest on how Triton's pipeliner spends stages: the page-id loads take some, so a decode tile holds ONE
K and V buffer at 3 stages and two at 5, the context tile two at 3 and three at 5. If a Triton
update moves that, the measured choices need measuring again.

Key lanes (`TileConfig.key_lanes`) must keep a decode tile's row max and sum inside warps: fewer CTA
barriers in the key loop than the same tile with its keys split over the warps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import triton
from tiers import ROOT

pytestmark = pytest.mark.skipif(not triton.__version__.startswith("3.9"),
                                reason="SASS shapes checked against the pinned Triton 3.9")


def sass_report(*flags: str) -> str:
    """What bench/bench_kernel_sass.py prints for these flags (a subprocess: the tests' interpreter is on)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "bench.bench_kernel_sass", *flags],
                          check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout


def opcode_counts(*flags: str) -> dict[str, int]:
    out = sass_report("--top", "0", *flags)
    return {op: int(n) for n, op in re.findall(r"^\s*(\d+)\s+(\S+)$", out, re.MULTILINE)}


@pytest.mark.parametrize("kernel_flags", [["--kernel", "paged", "--tile", "4,16,128"],
                                          ["--kernel", "context", "--rows", "16", "--stages", "3"]])
def test_fp8_values_reach_the_mma_without_byte_wise_shared_loads(kernel_flags):
    plain = opcode_counts(*kernel_flags, "--no-cvt-asm")
    widened = opcode_counts(*kernel_flags)
    assert plain.get("LDS.U8", 0) >= 128  # the problem the widening solves is still there to see
    assert widened.get("LDS.U8", 0) == 0
    assert widened.get("LDSM.16.MT88.4", 0) > plain.get("LDSM.16.MT88.4", 0)
    assert sum(widened.values()) < sum(plain.values())


@pytest.mark.parametrize("kernel_flags", [["--kernel", "paged", "--tile", "16,64,64", "--stages", "3"],
                                          ["--kernel", "context", "--rows", "64", "--tile", "0,0,128",
                                           "--stages", "3"]])
def test_e4m3_scores_take_the_stored_keys_into_the_hopper_mma(kernel_flags):
    fp16 = opcode_counts(*kernel_flags)
    e4m3 = opcode_counts(*kernel_flags, "--fp8-q")
    assert fp16.get("QGMMA.64", 0) == 0
    # each fp16 score MMA (k 16) becomes two e4m3 ones (k 32, q's two terms): as many instructions
    assert e4m3.get("QGMMA.64", 0) == fp16["HGMMA.64"] - e4m3["HGMMA.64"] > 0
    widen = "F2FP.F16.E4M3.UNPACK_B"
    assert e4m3[widen] < fp16[widen]  # the key tiles are no longer widened (q's terms widen once)


def kv_buffer_depths(*flags: str) -> set[int]:
    found = re.search(r"K/V buffer rings \(depth each\): \[([\d, ]*)\]", sass_report("--top", "1", *flags))
    return {int(x) for x in found.group(1).split(",")}


@pytest.mark.parametrize(("flags", "shallow", "deep"), [
    (["--kernel", "paged", "--cache", "fp8", "--tile", "4,16,128", "--key-lanes", "4"], 1, 2),
    (["--kernel", "paged", "--cache", "fp8", "--tile", "8,32,128"], 1, 2),
    (["--kernel", "context", "--cache", "bf16", "--rows", "64", "--tile", "0,0,64"], 2, 3)])
def test_five_stages_add_a_kv_buffer_behind_the_page_id_loads(flags, shallow, deep):
    assert kv_buffer_depths(*flags, "--stages", "3") == {shallow}
    assert kv_buffer_depths(*flags, "--stages", "5") == {deep}


def key_loop(*flags: str) -> tuple[int, int, int]:
    report = sass_report("--top", "1", *flags)
    found = re.search(r"key loop: (\d+) instructions, (\d+) CTA barriers, (\d+) local", report)
    return tuple(int(x) for x in found.groups())


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_key_lanes_keep_row_reductions_out_of_cta_barriers(cache):
    # a 16-row decode tile on 4 warps: one softmax state per warp instead of keys split over warps
    flags = ["--kernel", "paged", "--cache", cache, "--tile", "4,16,64", "--stages", "2"]
    _, split_barriers, _ = key_loop(*flags)
    _, lane_barriers, spills = key_loop(*flags, "--key-lanes", "4")
    assert lane_barriers < split_barriers
    assert spills == 0

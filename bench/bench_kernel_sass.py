"""Offline sm_90 build of the attention kernels: an instruction histogram, no GPU needed.

    python -m bench.bench_kernel_sass [--kernel paged|context] [--cache fp8|bf16]
        [--tile Q,M,N] [--rows R] [--warps W] [--stages S] [--split] [--no-cvt-asm] [--fp8-q]
        [--key-lanes L] [--source FILE] [--keep DIR] [--loop] [--top N]

Compiles one launch configuration of `kernels.paged_attention_kernel._paged_attention_kernel` (or of
`kernels.context_attention_kernel._context_attention_kernel`) with Triton for an H100/H200 target
(GPUTarget("cuda", 90)), disassembles the cubin with the cuobjdump bundled in Triton's wheel, and
prints how often each SASS opcode occurs, with the shared-memory size, the registers per thread, the
depth of the K/V buffer rings the pipeliner allocated and the first key loop's instructions, CTA
barriers and local-memory accesses. `--source` compiles another version of the kernel file instead
(for example ``git show COMMIT:kernels/paged_attention_kernel.py``), so two versions compare without
a device. `--keep DIR` writes the TTGIR, PTX and SASS there.

The build mirrors a launch of bench/bench_paged_attention.py (Qwen3-8B geometry: 32 query heads, 8 KV
heads, D 128, 16-token pages; the context kernel: group 4, 32-token pages, single pass) with the GPU
constexprs the launchers choose on an sm_90 device; integer strides are marked divisible by 16, and
unit strides made constants, as Triton's launcher does for such values. Static counts cover the
whole kernel (both key loops, the prologue and the epilogue): compare versions, do not read them as
per-tile costs; the key-loop line is the static cost of one unmasked key tile.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
CACHE_TYPES = {"fp8": "fp8e4nv", "bf16": "bf16"}
SCALAR_FLOATS = {"sm_scale", "k_scale", "v_scale", "sm_scale_log2"}
OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)


def load_kernel(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"sass_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return getattr(module, name)


def paged_build(args):
    """(kernel file, kernel name, pointer types, constexprs) of one paged launch."""
    cache = CACHE_TYPES[args.cache]
    block_q, block_m, block_n = args.tile
    pointers = {"Q": "*bf16", "K": f"*{cache}", "V": f"*{cache}", "Out": "*bf16", "PartAcc": "*fp32",
                "PartLse": "*fp32", "SplitLens": "*i32", "Counters": "*i32", "BlockTable": "*i32",
                "SeqLens": "*i32", "QueryStartLoc": "*i32", "KScale": "*fp32", "VScale": "*fp32"}
    fp8 = args.cache == "fp8"
    constexprs = dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_Q=block_q, BLOCK_M=block_m,
                      BLOCK_N=block_n, TOKENS_PER_BLOCK=16, SCALES_ON_DEVICE=fp8, SPLIT=args.split,
                      FUSED_MERGE=False, MERGE_CHUNK=4, DOT_DTYPE=tl.float16 if fp8 else tl.bfloat16,
                      USE_PDL=True, SEQ_SEARCH=1 if block_q * 4 <= 16 else 64, NARROW_Q=fp8,
                      FP8_CVT_ASM=args.cvt_asm, FP8_Q=fp8 and args.fp8_q, KEY_LANES=args.key_lanes)
    return "kernels/paged_attention_kernel.py", "_paged_attention_kernel", pointers, constexprs


def context_build(args):
    cache = CACHE_TYPES[args.cache]
    pointers = dict(q_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", block_table_ptr="*i32",
                    ctx_lens_ptr="*i32", k_noise_ptr="*bf16", v_noise_ptr="*bf16", out_ptr="*bf16",
                    part_acc_ptr="*fp32", part_lse_ptr="*fp32")
    fp8 = args.cache == "fp8"
    constexprs = dict(GROUP=4, HEAD_DIM=128, TOKENS_PER_BLOCK=32, ROWS=args.rows, NOISE_PAD=16,
                      BLOCK_N=args.tile[2], SPLIT=args.split, K_SCALE_MODE=1 if fp8 else 0,
                      V_SCALE_MODE=1 if fp8 else 0, COMPUTE=tl.float16 if fp8 else tl.bfloat16,
                      NOISE_COMPUTE=tl.bfloat16, NARROW_Q=fp8, PRECISION="tf32", USE_PDL=True,
                      FP8_CVT_ASM=args.cvt_asm, FP8_Q=fp8 and args.fp8_q)
    # the head-dim strides are 1, which Triton's launcher specialises as constants
    constexprs.update({f"stride_{t}d": 1 for t in ("q", "k", "v", "nk", "nv", "o")})
    return "kernels/context_attention_kernel.py", "_context_attention_kernel", pointers, constexprs


def compile_kernel(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    signature, attrs = {}, {}
    declared = [name for name in kernel.arg_names if name in constexprs]
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in SCALAR_FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride") and not name.endswith(("_lse_split", "_ls")):
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, {k: constexprs[k] for k in declared}, attrs)
    return triton.compile(source, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


def disassemble(cubin: bytes, workdir: Path) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(tool), "-sass", str(path)], check=True, capture_output=True, text=True).stdout


ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)(?:\s+(0x[0-9a-f]+))?")


def first_loop(sass: str) -> collections.Counter:
    """Opcodes of the first loop body (the first backward branch over 64+ instructions): the unmasked
    key loop of both attention kernels, what one key tile costs each warp."""
    code = [(int(a, 16), op, target) for a, op, target in ADDRESS.findall(sass)]
    for address, op, target in code:
        if op == "BRA" and target and address - int(target, 16) > 64 * 16:
            start = int(target, 16)
            return collections.Counter(o for a, o, _ in code if start <= a <= address)
    return collections.Counter()


PIPELINE_BUFFER = re.compile(
    r"= ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x[\dx]*x(?:f8E4M3FN|bf16|f16|f32),")


def kv_buffers(ttgir: str) -> list[int]:
    """Depth of each K or V buffer ring the pipeliner allocated (its mutable, argument-less shared
    allocations of a float tile), key loop by key loop: 1 means each tile's loads wait for the
    previous tile's compute."""
    return [int(depth) for depth in PIPELINE_BUFFER.findall(ttgir)]


def registers(workdir: Path) -> str:
    """Registers per thread of the cubin `disassemble` wrote (what bounds programs per SM)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(workdir / "kernel.cubin")], check=True,
                           capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    return found.group(1) if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("paged", "context"), default="paged")
    parser.add_argument("--cache", choices=tuple(CACHE_TYPES), default="fp8")
    parser.add_argument("--tile", default="4,16,128", help="BLOCK_Q,BLOCK_M,BLOCK_N (context: BLOCK_N only)")
    parser.add_argument("--rows", type=int, default=64, help="context kernel: padded query rows")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--split", action="store_true", help="the split-KV variant")
    parser.add_argument("--no-cvt-asm", dest="cvt_asm", action="store_false",
                        help="widen fp8 values with a plain cast (what Triton does without kernels.operands)")
    parser.add_argument("--fp8-q", action="store_true",
                        help="fp8 cache: e4m3 score dot (what kernels.operands.quantizes_q picks)")
    parser.add_argument("--key-lanes", type=int, default=1, help="paged kernel: softmax states per row")
    parser.add_argument("--source", type=Path, help="another version of the kernel file")
    parser.add_argument("--keep", type=Path, help="write TTGIR, PTX and SASS here")
    parser.add_argument("--loop", action="store_true", help="histogram of the key loop, not the whole kernel")
    parser.add_argument("--top", type=int, default=30, help="opcodes to print (0: all)")
    args = parser.parse_args()
    args.tile = tuple(int(x) for x in args.tile.split(","))
    if len(args.tile) != 3:
        raise SystemExit(f"--tile takes BLOCK_Q,BLOCK_M,BLOCK_N, got {args.tile}")
    path, name, pointers, constexprs = (paged_build if args.kernel == "paged" else context_build)(args)
    kernel = load_kernel(args.source or Path(path), name)
    compiled = compile_kernel(kernel, pointers, constexprs, args.warps, args.stages)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="kernel_sass_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sass = disassemble(compiled.asm["cubin"], workdir)
    if args.keep:
        (workdir / "kernel.ttgir").write_text(compiled.asm["ttgir"])
        (workdir / "kernel.ptx").write_text(compiled.asm["ptx"])
        (workdir / "kernel.sass").write_text(sass)
    counts = collections.Counter(OPCODE.findall(sass))
    print(f"{args.kernel} {args.cache} tile {args.tile} warps {args.warps} stages {args.stages}: "
          f"{sum(counts.values())} instructions, {compiled.metadata.shared} B shared memory, "
          f"{registers(workdir)} registers per thread")
    print(f"K/V buffer rings (depth each): {kv_buffers(compiled.asm['ttgir'])}")
    loop = first_loop(sass)
    print(f"key loop: {sum(loop.values())} instructions, {loop['BAR.SYNC.DEFER_BLOCKING']} CTA barriers, "
          f"{sum(n for op, n in loop.items() if op.startswith(('LDL', 'STL')))} local-memory accesses")
    for opcode, count in (loop if args.loop else counts).most_common(args.top or None):
        print(f"{count:6d}  {opcode}")


if __name__ == "__main__":
    main()

"""`dflash plan`: what a memory budget buys with the draft context paged versus dense."""

from __future__ import annotations

import argparse
import json

from dflash_cli.flags import byte_size
from foundation.byte_size import format_bytes
from foundation.checkpoint_config import load_drafter_config, load_target_config
from kvpool_service.geometry import DTYPE_NAMES, PoolPlan, PoolSpec, plan_pool


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="pool budget: blocks, tokens and concurrency, paged vs dense draft context",
        description="Size the KV pool of a target + DFlash drafter pair for a memory budget.",
    )
    parser.add_argument("--target", required=True, help="target checkpoint directory or its config.json")
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory or its config.json")
    parser.add_argument("--memory", required=True, help="pool budget: bytes, 40GiB, 512MiB, 2e9, ...")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--context-dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="dtype of the draft context (default: the target's dtype)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="dtype of the target's K/V pages: the target's dtype (auto) or float8 e4m3")
    parser.add_argument("--avg-seq-len", type=int, default=None,
                        help="tokens per request for the concurrency estimate (default: max-model-len)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = load_target_config(args.target)
    drafter = load_drafter_config(args.drafter)
    spec = PoolSpec.from_configs(
        target, drafter, tokens_per_block=args.tokens_per_block,
        dtype="fp8" if args.kv_cache_dtype == "fp8" else None,
        context_dtype=args.context_dtype or target.dtype_name,  # an fp8 target cache leaves the context alone
    )
    plan = plan_pool(
        spec, byte_size("--memory", args.memory), max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, avg_seq_len=args.avg_seq_len,
    )
    print(json.dumps(plan.model_dump(), indent=2) if args.json else render_plan(spec, plan))
    return 0


def render_plan(spec: PoolSpec, plan: PoolPlan) -> str:
    """The plan as a readable table; a storage left without a block gets a sentence instead of zeros."""
    lines = [f"pool of {format_bytes(plan.memory_bytes)}, {plan.tokens_per_block} tokens per block", ""]
    row = "{:<8} {:>6} {:>8} {:>8} {:>14} {:>12}".format
    lines.append(row("group", "layers", "kv heads", "head dim", "dtype", "bytes/token"))
    for group in spec.groups:
        lines.append(row(group.name, group.num_layers, group.num_kv_heads, group.head_dim, group.dtype,
                         f"{group.bytes_per_token:,}"))
    lines.append(row("total", "", "", "", "", f"{plan.total_bytes_per_token:,}"))
    lines += ["", f"{'context storage':<16} {'draft context':>14} {'target pool':>14} {'blocks':>8} "
                  f"{'max tokens':>12} {f'requests of {plan.avg_seq_len}':>20}"]
    for name, storage in (("paged", plan.paged), ("dense", plan.dense)):
        if storage.num_blocks == 0:
            lines.append(f"{name:<16} {format_bytes(storage.draft_context_bytes):>14}   "
                         f"{_no_block(name, spec, plan)}")
            continue
        lines.append(
            f"{name:<16} {format_bytes(storage.draft_context_bytes):>14} "
            f"{format_bytes(storage.target_pool_bytes):>14} {storage.num_blocks:>8,} "
            f"{storage.max_tokens:>12,} {storage.concurrent_requests:>20,}"
        )
    for name, storage in (("paged", plan.paged), ("dense", plan.dense)):
        if storage.uncapped_requests > plan.max_num_seqs:
            lines.append(f"({name}: the blocks hold {storage.uncapped_requests:,} requests of "
                         f"{plan.avg_seq_len} tokens; max_num_seqs {plan.max_num_seqs} caps how many run "
                         "at once)")
    lines.append(f"(dense reserves max_num_seqs {plan.max_num_seqs} x max_model_len {plan.max_model_len} "
                 "draft tokens up front)")
    return "\n".join(lines)


def _no_block(name: str, spec: PoolSpec, plan: PoolPlan) -> str:
    """Why a storage has no target pool, in words: a row of zeros reads like a bug."""
    if name == "paged":
        return (f"no target pool: one block of target + draft ({format_bytes(spec.bytes_per_block)}) is more "
                "than the budget; nothing can run")
    left = plan.memory_bytes - plan.dense.draft_context_bytes
    if left <= 0:
        return "no target pool: the dense reservation takes the whole budget; nothing can run"
    block = spec.without_draft().bytes_per_block
    return (f"no target pool: the {format_bytes(left)} the dense reservation leaves is less than one "
            f"block ({format_bytes(block)}); nothing can run")

"""`dflash plan`: what a memory budget buys with the draft context paged versus dense."""

from __future__ import annotations

import argparse
import json

from foundation.byte_size import format_bytes, parse_byte_size
from foundation.checkpoint_config import load_drafter_config, load_target_config
from kvpool_service.spec import CONTEXT_DTYPES, PoolPlan, PoolSpec, plan_pool


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
    parser.add_argument("--context-dtype", choices=sorted(CONTEXT_DTYPES), default=None,
                        help="dtype of the draft context (default: the target's dtype)")
    parser.add_argument("--avg-seq-len", type=int, default=None,
                        help="tokens per request for the concurrency estimate (default: max-model-len)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = load_target_config(args.target)
    drafter = load_drafter_config(args.drafter)
    spec = PoolSpec.from_configs(
        target, drafter, tokens_per_block=args.tokens_per_block, context_dtype=args.context_dtype
    )
    plan = plan_pool(
        spec, parse_byte_size(args.memory), max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, avg_seq_len=args.avg_seq_len,
    )
    print(json.dumps(plan.model_dump(), indent=2) if args.json else render_plan(spec, plan))
    return 0


def render_plan(spec: PoolSpec, plan: PoolPlan) -> str:
    """The plan as a readable table."""
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
        lines.append(
            f"{name:<16} {format_bytes(storage.draft_context_bytes):>14} "
            f"{format_bytes(storage.target_pool_bytes):>14} {storage.num_blocks:>8,} "
            f"{storage.max_tokens:>12,} {storage.concurrent_requests:>20,}"
        )
    lines.append(f"(dense reserves max_num_seqs {plan.max_num_seqs} x max_model_len {plan.max_model_len} "
                 "draft tokens up front and caps requests at max_num_seqs)")
    return "\n".join(lines)

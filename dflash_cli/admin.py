"""`dflash admin stats|health`: read a running KV pool server, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from dflash_cli.main import CliError

TRANSPORT_FAILURE = 1


def register(subparsers) -> None:
    admin = subparsers.add_parser("admin", help="inspect a running KV pool server",
                                  description="Read the stats or the health of a `dflash kvpool` server.")
    commands = admin.add_subparsers(dest="admin_command", metavar="COMMAND", required=True)
    for name, func, help_text in (
        ("stats", run_stats, "blocks per layer group, live sequences, prefix-cache hit rate, uptime"),
        ("health", run_health, "the standard gRPC health status of the server and of the KVPool service"),
    ):
        parser = commands.add_parser(name, help=help_text, description=help_text)
        parser.add_argument("--address", required=True, help="HOST:PORT of the pool server")
        parser.add_argument("--token-file", help="file holding the pool's bearer token (default: the token "
                                                 "itself in $DFLASH_KVPOOL_TOKEN)")
        parser.add_argument("--timeout", type=float, default=5.0, help="deadline of each call, seconds")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.set_defaults(func=func)


def _client(args: argparse.Namespace):
    from foundation.secret_file import POOL_TOKEN_ENV, load_secret
    from kvpool_service.client import KVPoolClient

    if args.timeout <= 0:
        raise CliError(f"--timeout must be positive, got {args.timeout}")
    if ":" not in args.address:
        raise CliError(f"--address must be HOST:PORT, got {args.address!r}")
    token = load_secret(args.token_file, env=POOL_TOKEN_ENV)
    return KVPoolClient(args.address, token=token, timeout=args.timeout)


def _fail(args: argparse.Namespace, error) -> int:
    """One sentence on stderr for a call that got no answer (or a refusal), exit status 1."""
    code = getattr(error, "code", None)
    reason = {
        "UNAVAILABLE": f"cannot reach the pool at {args.address} (UNAVAILABLE)",
        "DEADLINE_EXCEEDED": f"the pool at {args.address} did not answer within {args.timeout:g} s",
    }.get(code, f"the pool at {args.address} refused the call: {error}")
    print(f"dflash admin {args.admin_command}: error: {reason}", file=sys.stderr)
    return TRANSPORT_FAILURE


def message_dict(message) -> dict:
    """Every field of a proto message (defaults included), 64-bit ints as ints (not JSON strings)."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [message_dict(v) for v in value] if field.is_repeated else message_dict(value)
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


def stats_table(address: str, stats: dict) -> str:
    rows = [("group", "blocks", "free", "cached", "in use", "bytes/token")]
    rows += [(g["name"], *(str(g[k]) for k in ("num_blocks", "num_free_blocks", "num_cached_blocks",
                                                 "num_used_blocks", "bytes_per_token")))
             for g in stats["groups"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"pool {address}  epoch {stats['epoch']}  up {stats['uptime_s']:.1f} s",
             f"tokens per block {stats['tokens_per_block']}, live sequences {stats['num_seqs']}, "
             f"prefix-cache hit rate {100 * stats['prefix_cache_hit_rate']:.1f}% "
             f"({stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens)", ""]
    for row in rows:  # names left-aligned, numbers right-aligned
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    from kvpool_service.errors import PoolError

    with _client(args) as client:
        try:
            stats = message_dict(client.pool_stats())
        except PoolError as error:
            return _fail(args, error)
    print(json.dumps(stats, indent=2) if args.json else stats_table(args.address, stats))
    return 0


def run_health(args: argparse.Namespace) -> int:
    from kvpool_service.errors import PoolError
    from kvpool_service.server import SERVICE_NAME

    with _client(args) as client:
        try:
            status = {"server": client.health(""), SERVICE_NAME: client.health(SERVICE_NAME)}
        except PoolError as error:
            return _fail(args, error)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print("\n".join(f"{name}: {value}" for name, value in status.items()))
    return 0 if all(value == "SERVING" for value in status.values()) else TRANSPORT_FAILURE

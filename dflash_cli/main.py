"""The `dflash` command: one subcommand per module, each exposing `register(subparsers)`.

Every subcommand sets `func(args) -> exit code`. Errors a user can fix (bad sizes, bad configs,
bad values, bad flags) print one line, `dflash <cmd>: error: <flag or field>: ...`, to stderr and
exit 2, without a traceback. Logging is WARNING unless -v (INFO), -vv (DEBUG) or -q (errors only).

Building the parser must stay cheap (`dflash --help` and `dflash admin health` should not wait
for torch): `register()` imports nothing heavy; each subcommand imports torch, grpc and the
engines inside its `run`.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from pydantic import ValidationError

from dflash_cli.flags import (
    USAGE_ERROR,
    OneLineParser,
    add_verbosity_flags,
    attach_dash_values,
    log_level,
    walk_parsers,
)
from foundation.validation_error import InvalidSetting, describe

SUBCOMMAND_MODULES = (
    "dflash_cli.plan",
    "dflash_cli.generate",
    "dflash_cli.kvpool",
    "dflash_cli.admin",
    "dflash_cli.train",
    "dflash_cli.serve",
    "dflash_cli.bench",
)
BROKEN_PIPE = 128 + 13  # what a shell reports for a writer stopped by SIGPIPE (`cat big | head`)
INTERRUPTED = 128 + 2  # likewise for SIGINT


class CliError(ValueError):
    """A usage error raised inside a subcommand; printed as one line."""


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="dflash", description="Serve a target LLM with a DFlash drafter over one paged KV pool."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    add_verbosity_flags(parser)
    return parser


def _flag_namer(parser):
    """Names a field by its flag when it has one (kv_cache_memory: --kv-cache-memory), else as itself."""
    flags = {flag for level, _ in walk_parsers(parser) for action in level._actions
             for flag in action.option_strings}

    def name(field: str) -> str:
        flag = "--" + field.replace("_", "-")
        return flag if flag in flags else field

    return name


def _configure_logging(level: int) -> None:
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if "grpc" not in sys.modules:  # gRPC's C core logs to stderr on its own, read once at import
        grpc_level = "NONE" if level > logging.INFO else "ERROR" if level == logging.INFO else "DEBUG"
        os.environ.setdefault("GRPC_VERBOSITY", grpc_level)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_dash_values(parser, sys.argv[1:] if argv is None else argv))
    _configure_logging(log_level(args))
    try:
        return int(args.func(args) or 0)
    except ValidationError as error:  # the first problem; a check of the whole model is its message alone
        print(f"dflash {args.command}: error: {describe(error, _flag_namer(parser))}", file=sys.stderr)
    except InvalidSetting as error:  # a setting the engine refused, by its flag
        name = _flag_namer(parser)(error.field) if error.field else ""
        print(f"dflash {args.command}: error: {name + ': ' if name else ''}{error.message}", file=sys.stderr)
    except ValueError as error:  # ConfigError, CliError and bad values are ValueErrors
        print(f"dflash {args.command}: error: {error}", file=sys.stderr)
    return USAGE_ERROR


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: a reader that left shows up here at the latest
    except BrokenPipeError:
        # The reader closed the pipe (`dflash admin stats | head -2`): stop quietly, as `cat` does, and
        # point stdout at /dev/null so the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt:
        return INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The `dflash` command: one subcommand per module, each exposing `register(subparsers)`.

Every subcommand sets `func(args) -> exit code`. Errors a user can fix (bad sizes, bad configs,
bad values) print one sentence to stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pydantic import ValidationError

SUBCOMMAND_MODULES = (
    "dflash_cli.plan",
    "dflash_cli.generate",
    "dflash_cli.kvpool",
    "dflash_cli.admin",
    "dflash_cli.train",
)
USAGE_ERROR = 2


class CliError(ValueError):
    """A usage error raised inside a subcommand; printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash", description="Serve a target LLM with a DFlash drafter over one paged KV pool."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    return f"{field}: {first['msg'].removeprefix('Value error, ')}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except ValidationError as error:
        print(f"dflash {args.command}: error: {_first_error(error)}", file=sys.stderr)
    except ValueError as error:  # ConfigError, CliError and bad values are ValueErrors
        print(f"dflash {args.command}: error: {error}", file=sys.stderr)
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())

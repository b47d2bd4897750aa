"""What every `dflash` subcommand's flags share: one-line usage errors, -v/-q at every level, values
that look negative, and byte sizes named by their flag.

argparse alone gets three things wrong for this command: its usage errors print the whole usage
before the error (every other error of the command is one line); a flag given after the
subcommand (`dflash generate -v`) is unknown unless that subparser defines it too; and
`--memory -5GiB` is refused as "expected one argument", because '-5GiB' looks like a flag, so
the value never reaches the validation that would name the real problem.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

from foundation.byte_size import parse_byte_size

USAGE_ERROR = 2
LOG_LEVELS = (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)  # -q, default, -v, -vv
DEFAULT_LEVEL = 1  # index of WARNING in LOG_LEVELS


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, `dflash <cmd>: error: ...`, exit status 2.

    `add_subparsers` makes its subparsers of the parent's class, so the whole tree has this error.
    """

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def walk_parsers(parser: argparse.ArgumentParser, depth: int = 0
                 ) -> Iterator[tuple[argparse.ArgumentParser, int]]:
    """`parser` and every subparser below it, with its depth (0: the top)."""
    yield parser, depth
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias maps to the same parser
                yield from walk_parsers(sub, depth + 1)


def add_verbosity_flags(parser: argparse.ArgumentParser) -> None:
    """-v / -q on the top parser and on every subparser, each level counted under its own name.

    One name for all levels would not do: argparse copies a subparser's defaults over what the
    levels above parsed, so `dflash -v generate` would lose its -v.
    """
    for level, depth in walk_parsers(parser):
        level.add_argument("-v", "--verbose", action="count", default=0, dest=f"verbose_{depth}",
                           help="log INFO lines (-vv: DEBUG too); the default is warnings and errors")
        level.add_argument("-q", "--quiet", action="count", default=0, dest=f"quiet_{depth}",
                           help="log errors only")


def log_level(args: argparse.Namespace) -> int:
    """The logging level of all -v and -q given, at any level: each -v one step up, each -q one down."""
    steps = sum(value if name.startswith("verbose_") else -value
                for name, value in vars(args).items() if name.startswith(("verbose_", "quiet_")))
    return LOG_LEVELS[min(max(DEFAULT_LEVEL + steps, 0), len(LOG_LEVELS) - 1)]


def attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--memory -5GiB` -> `--memory=-5GiB` wherever a flag taking one value is followed by a word
    with one leading dash that is not itself a flag; everything after `--` is left alone."""
    one_value: set[str] = set()
    other: set[str] = set()
    for level, _ in walk_parsers(parser):
        for action in level._actions:
            takes_one = action.nargs is None or action.nargs == 1
            (one_value if takes_one else other).update(action.option_strings)
    one_value -= other  # a flag taking a value in one subcommand and none in another: leave it be
    known = one_value | other
    out: list[str] = []
    i = 0
    while i < len(argv):
        word, value = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if word == "--":
            return out + argv[i:]
        dash_value = value.startswith("-") and not value.startswith("--") and value[:2] not in known
        if word in one_value and dash_value and value != "-":
            out.append(f"{word}={value}")
            i += 2
        else:
            out.append(word)
            i += 1
    return out


def byte_size(flag: str, text: str) -> int:
    """`text` in bytes; a ValueError naming `flag` when it is no positive size."""
    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def add_proposer_flags(parser: argparse.ArgumentParser) -> None:
    """Who drafts, as `dflash serve` and `dflash generate` both take it (EngineArgs' names)."""
    parser.add_argument("--speculative-method", choices=("dflash", "ngram", "hybrid"),
                        help="who drafts: the DFlash drafter, prompt lookup over the prompt and output "
                             "(ngram: no drafter), or per sequence and step the better of the two (hybrid); "
                             "default: dflash with a drafter, plain decoding without")
    parser.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=None,
                        help="each step verifies the number of drafts (0..K) with the most tokens per "
                             "second, from acceptance measured per draft position and step times measured "
                             "online (dflash only; default: on on a GPU unless -k pins K, off on a CPU)")
    parser.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram lookup matches")
    parser.add_argument("--prompt-lookup-max", type=int, default=3, help="longest n-gram lookup matches")

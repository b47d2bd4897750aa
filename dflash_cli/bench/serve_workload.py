"""What `dflash bench serve` sends: prompt and output lengths from a distribution, and the passes.

Lengths: `--input-len` / `--output-len` take one integer or a range MIN-MAX (uniform integers), or
`--input-lens-file` / `--output-lens-file` a file of real lengths (one integer per line, or a JSON list),
sampled with replacement. Passes: within each rate or concurrency setting, `--passes` runs in order;
`new` sends prompts no earlier pass of the run sent, `repeat` exactly the prompts of the pass before
it (a prefix-cache hit on a server that has one). `new repeat repeat new` measures a first visit, two
returns and then fresh prompts again, of the same length distribution.

Every prompt of the run comes from one seeded draw, before anything is sent: the warm-up request's
first, then `--num-prompts` for each `new` pass, so a run is reproducible from its --seed and the
warm-up never sends a prompt that is measured afterwards. Plain Python over ints: the prompts
themselves come from a function the caller passes (corpus windows or random ids, `serve_load`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PASS_KINDS = ("new", "repeat")
_LENGTH = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")  # N or MIN-MAX

# (count, input_len, seed) -> `count` prompts of `input_len` token ids, deterministic in the seed
PromptSource = Callable[[int, int, int], list[list[int]]]


@dataclass(frozen=True)
class Lengths:
    """A distribution of request lengths: uniform integers in [low, high], or, when `values` is set
    (a lens file's), those values sampled with replacement. `source` is what the user wrote."""

    low: int
    high: int
    source: str
    values: tuple[int, ...] | None = None

    def sample(self, count: int, rng: random.Random) -> list[int]:
        if self.values is not None:
            return rng.choices(self.values, k=count)
        return [rng.randint(self.low, self.high) for _ in range(count)]

    @property
    def label(self) -> str:
        """In words, for the markdown: `64`, `8-64 (uniform)`, `lens.txt (500 values, 3-900)`."""
        if self.values is not None:
            return f"{self.source} ({len(self.values)} values, {self.low}-{self.high})"
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high} (uniform)"


def parse_length(flag: str, text: str | int) -> Lengths:
    """`N` or `MIN-MAX` with 1 <= MIN <= MAX, else a one-line ValueError naming `flag` (an integer
    below 1 gets the message every other count flag gives)."""
    if re.fullmatch(r"\s*-?\d+\s*", str(text)) and int(text) < 1:
        raise ValueError(f"{flag}: must be at least 1, got {int(text)}")
    match = _LENGTH.match(str(text))
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= low <= high:
        raise ValueError(f"{flag}: expected N or MIN-MAX with 1 <= MIN <= MAX, got {str(text)!r}")
    return Lengths(low, high, str(text).strip())


def read_lens_file(flag: str, path: str) -> Lengths:
    """Every length in a file (one integer per line, blank lines skipped, or one JSON list); a missing
    or empty file, or any value that is not a positive integer, is a ValueError naming the file and line."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag}: no file {path}")
    try:
        text = file.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path} is not text") from None
    items = _json_items(flag, path, text) if text.lstrip().startswith("[") else _line_items(text)
    if not items:
        raise ValueError(f"{flag}: {path} is empty (expected one integer per line, or a JSON list)")
    for line, value, shown in items:
        if value is None or value < 1:
            raise ValueError(f"{flag}: {path} line {line}: expected a positive integer, got {shown!r}")
    values = tuple(value for _, value, _ in items)
    return Lengths(min(values), max(values), path, values)


def _line_items(text: str) -> list[tuple[int, int | None, str]]:
    """(line, the integer or None, the text) of each line that is not blank."""
    return [(number, int(line) if re.fullmatch(r"\s*\+?\d+\s*", line) else None, line.strip())
            for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _json_items(flag: str, path: str, text: str) -> list[tuple[int, int | None, str]]:
    """(line, the integer or None, the item as JSON) of each item of a JSON list: the list is walked
    with raw_decode to learn the lines. `true` and `"7"` are no integers here."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag}: {path} line {error.lineno}: not a JSON list ({error.msg})") from None
    decoder, position, items = json.JSONDecoder(), text.index("[") + 1, []
    line, counted = 1, 0  # newlines counted up to `counted` (once each: a long file stays linear)
    for value in values:
        while text[position] in " \t\r\n,":  # to the item's first character
            position += 1
        line, counted = line + text.count("\n", counted, position), position
        items.append((line, value if type(value) is int else None, json.dumps(value)))
        _, position = decoder.raw_decode(text, position)
    return items


def lengths_from_args(args: argparse.Namespace, which: str) -> Lengths:
    """`--{which}-lens-file` when given, else `--{which}-len` (which: input or output)."""
    path = getattr(args, f"{which}_lens_file", None)
    if path:
        return read_lens_file(f"--{which}-lens-file", path)
    return parse_length(f"--{which}-len", getattr(args, f"{which}_len"))


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The lengths, passes and warm-up flags (part of `serve_load.add_arguments`)."""
    for which, default, what in (("input", 64, "prompt tokens"), ("output", 128, "tokens per request")):
        group = parser.add_mutually_exclusive_group()
        group.add_argument(f"--{which}-len", default=str(default), metavar="N|MIN-MAX",
                           help=f"{what}: N, or uniform integers MIN-MAX drawn with --seed "
                           f"(default: {default})")
        group.add_argument(f"--{which}-lens-file", metavar="FILE",
                           help=f"{what} sampled (with replacement, --seed) from FILE: one integer per line, "
                           "or a JSON list")
    parser.add_argument("--passes", nargs="+", choices=PASS_KINDS, default=["new"], metavar="KIND",
                        help="passes run in order at each setting, each reported on its own: new (prompts "
                        "no earlier pass sent) or repeat (the pass before it again: prefix-cache hits); "
                        "e.g. new repeat repeat new (default: new)")
    parser.add_argument("--cold", action="store_true",
                        help="no warm-up request: the first measured request is the server's first")


def check_workload_args(args: argparse.Namespace) -> None:
    """Each length flag and lens file parses, and the passes begin with a new one (one-line ValueErrors)."""
    lengths_from_args(args, "input")
    lengths_from_args(args, "output")
    check_passes(args.passes)


def check_passes(kinds: list[str]) -> None:
    if not kinds or kinds[0] != "new":
        raise ValueError(f"--passes: the first pass must be new (a repeat sends the pass before it "
                         f"again), got {' '.join(kinds)!r}")


def plan_passes(kinds: list[str], settings: int) -> list[list[int]]:
    """Per setting, the draw each pass sends: the n-th `new` pass of the whole run sends draw n (so no
    setting sends a prompt an earlier one did), a `repeat` the draw of the pass before it."""
    check_passes(kinds)
    plans, draws = [], 0
    for _ in range(settings):
        plan: list[int] = []
        for kind in kinds:
            if kind == "new":
                draws += 1
            plan.append(draws - 1)
        plans.append(plan)
    return plans


@dataclass(frozen=True)
class Prompt:
    """One request's prompt (token ids) and the tokens it asks for."""

    token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Pass:
    """One pass of a setting: `--num-prompts` prompts, sent at the setting's rate or concurrency."""

    kind: str  # new or repeat
    prompts: list[Prompt]


@dataclass(frozen=True)
class SettingPlan:
    """One rate or concurrency level and its passes, in the order `--passes` gave them."""

    mode: str  # request_rate or concurrency
    value: float
    passes: list[Pass]


@dataclass(frozen=True)
class RunPlan:
    """Everything a run sends, resolved from the flags before the first request."""

    warmup: Prompt | None  # None: --cold, the first measured request is the server's first
    settings: list[SettingPlan]


def draw_prompts(count: int, inputs: Lengths, outputs: Lengths, seed: int,
                 source: PromptSource) -> list[Prompt]:
    """`count` prompts with seeded lengths: windows of the longest drawn length, each cut to its own."""
    rng = random.Random(seed)
    input_lens, output_lens = inputs.sample(count, rng), outputs.sample(count, rng)
    windows = source(count, max(input_lens), seed)
    return [Prompt(window[:n], m) for window, n, m in zip(windows, input_lens, output_lens)]


def plan_run(args: argparse.Namespace, source: PromptSource) -> RunPlan:
    """The settings in the order given (rates, then concurrency levels), each with its passes, and the
    warm-up. The warm-up's prompt is drawn even with --cold, so a cold run and a warm one of the same
    --seed measure the same prompts."""
    modes = [("request_rate", rate) for rate in args.request_rate or ()]
    modes += [("concurrency", level) for level in args.concurrency or ()]
    plans = plan_passes(args.passes, len(modes))
    draws = 1 + max((draw for plan in plans for draw in plan), default=-1)
    count = args.num_prompts
    prompts = draw_prompts(1 + draws * count, lengths_from_args(args, "input"),
                           lengths_from_args(args, "output"), args.seed, source)
    warmup, measured = prompts[0], prompts[1:]
    settings = [SettingPlan(mode, value, [Pass(kind, measured[draw * count:(draw + 1) * count])
                                          for kind, draw in zip(args.passes, plan)])
                for (mode, value), plan in zip(modes, plans)]
    return RunPlan(None if args.cold else warmup, settings)


def setting_label(mode: str, value: float) -> str:
    """`rate 4` or `concurrency 8`: a setting's name in the progress bar, the tables and the plots."""
    return f"{'rate' if mode == 'request_rate' else 'concurrency'} {value:g}"

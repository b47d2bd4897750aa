"""`dflash bench serve` (load against an OpenAI-compatible URL) and `dflash bench step` (the engine's
step, forwarded word for word to `python -m dflash_cli.bench.step`).

The benches are product code of this package, one noun per module: `serve_load` (the load generator
and its flags), `serve_request` (one timed request), `serve_workload` (lengths and passes),
`serve_gaps`, `serve_report` (its numbers and files) and `serve_plots`; `step` (the step bench's
method and parser), `step_report`, `step_timing`, `step_limits`, `hf_step`, `random_pair` (the
random-weight checkpoints it times), `simulated_acceptance`, `varied_workload` (a randomised workload
through an engine); `plotting` (matplotlib, an optional extra).

`bench serve` takes its flags from `dflash_cli.bench.serve_load.add_arguments`, so both entry points
parse the same flags; that module imports nothing heavy at the top. `bench step` owns no flags but
-v/-q: every other word goes to the step bench's own parser (its --help included), which would
otherwise have to be imported, torch and all, whenever the `dflash` parser is built.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from dflash_cli.flags import OneLineParser


class _BenchParser(OneLineParser):
    """A bench subparser; one that forwards keeps the words it does not know, in order, in `forward`."""

    forwards = False

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        if self.forwards:
            namespace.forward = rest
            return namespace, []
        return namespace, rest


def register(subparsers) -> None:
    from dflash_cli.bench.serve_load import add_arguments

    parser = subparsers.add_parser(
        "bench", help="benchmarks: load a server, time the engine's step",
        description="Benchmarks; each writes JSON, markdown and a PNG (the PNG needs matplotlib: "
        "pip install 'dflash-serve[bench]').")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True, parser_class=_BenchParser)
    serve = benches.add_parser(
        "serve", help="load an OpenAI-compatible server (this one or another) at request rates or "
        "concurrency levels", description="Latency percentiles (TTFT, TPOT, ITL, E2E), throughput and "
        "acceptance of an OpenAI-compatible server under Poisson arrivals or fixed concurrency.")
    add_arguments(serve)
    serve.set_defaults(func=run_serve)
    step = benches.add_parser(
        "step", add_help=False, allow_abbrev=False,
        help="the speculative step through the engine (python -m dflash_cli.bench.step; --help for its "
        "flags)", description="Forwards every flag but -v/-q to python -m dflash_cli.bench.step.")
    step.forwards = True
    step.set_defaults(func=run_step)


def run_serve(args: argparse.Namespace) -> int:
    from dflash_cli.bench.serve_load import run

    args.command_line = shlex.join(["dflash", *sys.argv[1:]])
    return run(args)


def run_step(args: argparse.Namespace) -> int:
    from dflash_cli.bench.step import main

    return main(args.forward) or 0

"""Benchmarks and the tools around them, one module each, run from the repository root:

    python -m bench.<module> --help

Their results, with the command, device, commit and date of each, are in bench/results/ (index:
bench/results/README.md).
"""

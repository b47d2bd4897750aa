"""Train the built-in demo pair end to end (target, then drafter, then its evaluation) in one run.

    python -m bench.bench_train_demo --out DIR [--target-seconds 150 --drafter-seconds 130] [--device cuda]

Runs the two `dflash train` commands exactly as a user would (their argv is logged and written to
DIR/commands.json), then packs each model directory into DIR/target.tar and DIR/drafter.tar (one
file each, so the pair travels back from a remote machine whole). Training is bounded by wall time
(`--time-budget`), so the run fits a fixed lease; the step counts reached are in the train logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import tarfile
import time
from pathlib import Path

import torch

from dflash_cli.main import main as dflash

logger = logging.getLogger("bench.bench_train_demo")


def _pack(directory: Path, archive: Path) -> None:
    """The model files only (no training checkpoints): what ships as package data."""
    with tarfile.open(archive, "w") as tar:
        for file in sorted(directory.iterdir()):
            if file.is_file():
                tar.add(file, arcname=f"{directory.name}/{file.name}")


def _run(argv: list[str], commands: list[dict]) -> float:
    logger.info("$ dflash %s", " ".join(argv))
    started = time.monotonic()
    code = dflash(argv)
    seconds = round(time.monotonic() - started, 1)
    commands.append({"argv": ["dflash", *argv], "exit_code": code, "wall_seconds": seconds})
    if code:
        raise SystemExit(f"dflash {' '.join(argv[:2])} exited with {code}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/demo_pair")
    parser.add_argument("--target-seconds", type=float, default=150)
    parser.add_argument("--drafter-seconds", type=float, default=130)
    parser.add_argument("--device")
    parser.add_argument("--seed", default="0")
    parser.add_argument("--generated", default="1536")
    parser.add_argument("--target-args", default="", help="more `train target` flags, one string")
    parser.add_argument("--drafter-args", default="", help="more `train drafter` flags, one string")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = ["--device", args.device] if args.device else []
    commands: list[dict] = []
    _run(["train", "target", "--out", str(work / "target"), "--seed", args.seed,
          "--time-budget", str(args.target_seconds), "--steps", "20000", "--batch-size", "64", *device,
          *shlex.split(args.target_args)], commands)
    _pack(work / "target", out / "target.tar")
    _run(["train", "drafter", "--target", str(work / "target"), "--out", str(work / "drafter"),
          "--seed", args.seed, "--time-budget", str(args.drafter_seconds), "--steps", "20000",
          "--batch-size", "64", "--anchors", "48", "--generated", args.generated,
          "--generated-fraction", "0.75", *device, *shlex.split(args.drafter_args)], commands)
    _pack(work / "drafter", out / "drafter.tar")
    environment = {"python": platform.python_version(), "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                   else platform.processor()}
    (out / "commands.json").write_text(json.dumps({"commands": commands, **environment}, indent=2) + "\n")


if __name__ == "__main__":
    main()

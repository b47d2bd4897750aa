"""`dflash train target` and `dflash train drafter`: flags map one to one onto the args models."""

from __future__ import annotations

import argparse
import json
import typing

from training.run_args import TrainDrafterArgs, TrainTargetArgs


def _flags(parser: argparse.ArgumentParser, model, skip: tuple[str, ...] = ()) -> None:
    """One --flag per field of `model` (bools as --flag / --no-flag), default None: the model's default."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"(default: {field.default})"
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name == "corpus":
            parser.add_argument(flag, nargs="+", default=None, metavar="PATH",
                                help="files or directories of .py sources (default: this Python's stdlib)")
        else:
            types = (field.annotation, *typing.get_args(field.annotation))
            kind = next((t for t in types if t in (int, float)), str)
            parser.add_argument(flag, type=kind, default=None, help=help_text)


def _args(args: argparse.Namespace, model):
    given = {name: getattr(args, name) for name in model.model_fields
             if getattr(args, name, None) is not None}
    return model.model_validate(given)


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a small target, or a DFlash drafter for a target",
                                   description="Train a small Qwen3 target or a DFlash drafter.")
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    target = kinds.add_parser("target", help="a small Qwen3 LM from scratch (HF layout)",
                              description="Train a small Qwen3 LM from scratch; save it in HF layout.")
    target.add_argument("--out", required=True, help="output directory (weights, tokenizer, train_log.json)")
    _flags(target, TrainTargetArgs, skip=("out",))
    target.set_defaults(func=run_target)
    drafter = kinds.add_parser("drafter", help="a DFlash drafter for a frozen target (DFlash layout)",
                               description="Train a DFlash drafter for a target; evaluate its acceptance.")
    drafter.add_argument("--target", required=True, help="target checkpoint directory (HF layout)")
    drafter.add_argument("--out", required=True, help="output directory (weights, eval.json, train_log.json)")
    _flags(drafter, TrainDrafterArgs, skip=("target", "out"))
    drafter.set_defaults(func=run_drafter)


def _report(summary: dict) -> int:
    """The summary without the loss curve (that stays in train_log.json) on stdout, as JSON."""
    print(json.dumps({key: value for key, value in summary.items() if key != "history"}, indent=2))
    return 0


def run_target(args: argparse.Namespace) -> int:
    from training.train_target import train_target

    return _report(train_target(_args(args, TrainTargetArgs)))


def run_drafter(args: argparse.Namespace) -> int:
    from training.train_drafter import train_drafter

    return _report(train_drafter(_args(args, TrainDrafterArgs)))

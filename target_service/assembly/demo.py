"""The built-in demo pair: a small Qwen3 target and its DFlash drafter, shipped as package data.

A fresh machine has no model hub, so `LLM()` and `dflash generate` without a target use this pair
(target_service/demo_models/, HF and DFlash layouts; how it was trained is in its MODEL_CARD.md).
`resolve_pair` is the one rule both follow: no target means the demo target with the demo drafter;
the drafter "none" means plain decoding.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_models"
NO_DRAFTER = "none"


class DemoModelMissing(ValueError):
    """The demo pair's files are not where the package should have them."""


def _demo(name: str) -> Path:
    path = DEMO_DIR / name
    if not (path / "config.json").is_file():
        raise DemoModelMissing(f"the demo {name} is missing from {path} (an install without package data?); "
                               "give a checkpoint directory instead")
    return path


def demo_target_path() -> Path:
    """The demo target (HF layout: config.json, safetensors shards, tokenizer.json)."""
    return _demo("target")


def demo_drafter_path() -> Path:
    """The demo DFlash drafter, trained for `demo_target_path()`."""
    return _demo("drafter")


def resolve_pair(target: str | Path | None, drafter: str | Path | None,
                 speculative_method: str | None = None) -> tuple[str, str | None]:
    """(target, drafter or None) to load: no target -> the demo pair (the demo target alone for prompt
    lookup, which takes no drafter); drafter 'none' -> plain decoding."""
    if target is None:
        target = demo_target_path()
        if drafter is None and speculative_method != "ngram":
            drafter = demo_drafter_path()
    if drafter is not None and str(drafter) == NO_DRAFTER:
        drafter = None
    return str(target), None if drafter is None else str(drafter)

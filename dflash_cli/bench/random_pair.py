"""Random-weight checkpoint pairs of a real geometry, for timing the engine end to end.

The configs come from a directory holding a target and a drafter `config.json` (default: the
checkout's `examples/`, Qwen3-8B and its 5-layer DFlash-b16 drafter), or from `tiny`, a small pair
for a CPU smoke run. The tensors follow the loaders' own layouts (`target_weight_layout`,
`drafter_weight_layout`), so what is written is exactly what the engine reads. Projections are
N(0, 0.02), norms are 1: random, but with the scale of a trained model's activations, so no step
overflows in bf16. Acceptance of a random pair is near zero; the step bench simulates it.

The benches that run on such a pair share its flags (`add_pair_arguments`), how they become a device,
a dtype and the written pair (`random_pair_for`), and how a result names its device (`device_name`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from drafter_service.model import drafter_weight_layout
from foundation.checkpoint_config import load_drafter_config, load_target_config
from target_service.runner.model import target_weight_layout
from training.export import save_sharded

logger = logging.getLogger(__name__)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # the checkout's, beside dflash_cli/
GEOMETRIES = {"qwen3-8b": (EXAMPLES / "qwen3-8b", EXAMPLES / "qwen3-8b-dflash-b16")}
SHARD_BYTES = 4 << 30

TINY_TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 8,
    "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 2]},
    "num_target_layers": 4,
    **{
        key: TINY_TARGET[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "vocab_size",
            "torch_dtype",
        )
    },
    "num_hidden_layers": 2,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def _random(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape, dtype=dtype)
    values = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
    return values.to(dtype).cpu()


def _write(directory: Path, config: dict, layout: dict, dtype: torch.dtype, seed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {
        name: _random(tuple(slot.shape), dtype, generator, device) for name, slot in layout.items()
    }
    save_sharded(tensors, directory, SHARD_BYTES)


def write_random_pair(
    out: Path, geometry: str, *, dtype: str = "bfloat16", seed: int = 0, target_layers: int | None = None
) -> tuple[Path, Path]:
    """Write `out/target` and `out/drafter` (once: an existing pair of the same configs is reused).

    target_layers: keep every shape of the geometry but only this many target layers, the drafter's
    taps moved onto the last of them: the same kernels, in seconds rather than minutes (for probes
    that care which kernels run, not how long the model takes)."""
    if geometry == "tiny":
        target_json, drafter_json = dict(TINY_TARGET), dict(TINY_DRAFTER)
    else:
        target_dir, drafter_dir = GEOMETRIES[geometry]
        if not (target_dir / "config.json").is_file():  # an installed wheel holds no examples/
            raise ValueError(f"--geometry {geometry}: no {target_dir / 'config.json'} (the geometries are "
                             "the configs in a checkout's examples/: run from a checkout, or use tiny)")
        target_json = json.loads((target_dir / "config.json").read_text())
        drafter_json = json.loads((drafter_dir / "config.json").read_text())
    target_json["torch_dtype"] = drafter_json["torch_dtype"] = dtype
    if target_layers is not None:
        _keep_target_layers(target_json, drafter_json, target_layers)
    target_out, drafter_out = out / "target", out / "drafter"
    stamp = out / "pair.json"
    wanted = {"target": target_json, "drafter": drafter_json, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return target_out, drafter_out
    shutil.rmtree(out, ignore_errors=True)
    torch_dtype = getattr(torch, dtype)
    target_out.mkdir(parents=True)
    (target_out / "config.json").write_text(json.dumps(target_json, indent=2) + "\n")
    target_config = load_target_config(target_out)
    _write(target_out, target_json, target_weight_layout(target_config), torch_dtype, seed)
    drafter_out.mkdir(parents=True)
    (drafter_out / "config.json").write_text(json.dumps(drafter_json, indent=2) + "\n")
    drafter_config = load_drafter_config(drafter_out)
    _write(drafter_out, drafter_json, drafter_weight_layout(drafter_config), torch_dtype, seed + 1)
    stamp.write_text(json.dumps(wanted))
    return target_out, drafter_out


def _keep_target_layers(target_json: dict, drafter_json: dict, layers: int) -> None:
    taps = drafter_json["dflash_config"]["target_layer_ids"]
    if not len(taps) <= layers <= target_json["num_hidden_layers"]:
        raise ValueError(f"target_layers: between the drafter's {len(taps)} taps and the geometry's "
                         f"{target_json['num_hidden_layers']} layers, got {layers}")
    target_json["num_hidden_layers"] = drafter_json["num_target_layers"] = layers
    drafter_json["dflash_config"]["target_layer_ids"] = list(range(layers - len(taps), layers))


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `random_pair_for` reads: --geometry, --checkpoints, --dtype, --device, --seed."""
    parser.add_argument("--geometry", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    parser.add_argument(
        "--checkpoints", default="/tmp/dflash-e2e-pair", help="where the random pair is written"
    )
    parser.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on a GPU)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)


def random_pair_for(args) -> tuple[torch.device, str, Path, Path]:
    """The device (--device, else cuda when there is one), the dtype (--dtype, else bf16 on a GPU
    and fp32 on CPU) and the random pair of --geometry written (once) under --checkpoints."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    started = time.perf_counter()
    target, drafter = write_random_pair(Path(args.checkpoints), args.geometry, dtype=dtype, seed=args.seed)
    logger.info("checkpoints ready in %.1f s", time.perf_counter() - started)
    return device, dtype, target, drafter


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"

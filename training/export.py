"""Writing trained models in the layouts the loaders read: HF for the target, DFlash for the drafter.

Both are safetensors, sharded by size with a `model.safetensors.index.json` when one file would
exceed `max_shard_bytes` (package data must stay under a per-file limit). The configs are written
in the classic HF spelling and validated by reading them back through the loaders' own checks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from foundation.checkpoint_config import load_drafter_config, load_target_config
from foundation.weights import INDEX_FILE, SINGLE_FILE

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _clear(directory: Path) -> None:
    """Drop weight files of an earlier export, so the loader cannot mix old and new shards."""
    for file in [*directory.glob("*.safetensors"), directory / INDEX_FILE]:
        file.unlink(missing_ok=True)


def save_sharded(tensors: dict[str, torch.Tensor], directory: str | Path, max_shard_bytes: int) -> list[Path]:
    """Save `tensors` as model.safetensors, or as shards of at most max_shard_bytes plus an index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _clear(directory)
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_shard_bytes:
            raise ValueError(f"tensor {name} has {nbytes} bytes, more than max_shard_bytes {max_shard_bytes}")
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return [directory / SINGLE_FILE]
    files, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        file = directory / f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file.name))
        files.append(file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
    return files


def _cast(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    return {name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()}


def target_config_json(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                       num_heads: int, num_kv_heads: int, head_dim: int, max_position_embeddings: int,
                       rope_theta: float, eos_token_id: int, dtype: str) -> dict:
    """A Qwen3ForCausalLM config.json (classic HF field spelling)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "torch_dtype": dtype, "use_cache": True, "use_sliding_window": False, "sliding_window": None,
    }


def drafter_config_json(target: dict, *, num_layers: int, block_size: int, mask_token_id: int,
                        target_layer_ids: list[int], intermediate_size: int, dtype: str) -> dict:
    """A DFlash drafter config.json fitting `target` (its config.json as a dict)."""
    shared = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "rope_theta", "max_position_embeddings", "vocab_size")
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "num_target_layers": target["num_hidden_layers"], "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size, "hidden_act": "silu", "rope_scaling": None,
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
        **{key: target[key] for key in shared},
    }


def export_target(directory: str | Path, model: torch.nn.Module, config_json: dict, tokenizer: Tokenizer,
                  *, max_shard_bytes: int) -> Path:
    """HF layout: config.json, generation_config.json, tokenizer.json, safetensors (shards)."""
    directory = Path(directory)
    state = {name: t for name, t in model.state_dict().items()}
    save_sharded(_cast(state, config_json["torch_dtype"]), directory, max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    generation = {"bos_token_id": config_json["bos_token_id"], "eos_token_id": config_json["eos_token_id"],
                  "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(directory / "tokenizer.json"))
    load_target_config(directory)  # the loader's own validation, before anyone relies on the files
    logger.info("target saved to %s", directory)
    return directory


def export_drafter(directory: str | Path, model: torch.nn.Module, config_json: dict, *,
                   max_shard_bytes: int) -> Path:
    """DFlash layout: config.json and safetensors (no embeddings, no lm_head)."""
    directory = Path(directory)
    save_sharded(_cast(dict(model.state_dict()), config_json["torch_dtype"]), directory, max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    load_drafter_config(directory)
    logger.info("drafter saved to %s", directory)
    return directory

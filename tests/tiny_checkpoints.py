"""Write tiny random checkpoints in the real on-disk layouts, for tests of loading and serving.

    write_target_checkpoint(dir, arch="qwen3"|"llama", tied=..., sharded=..., tokenizer=..., seed=...)
    write_drafter_checkpoint(dir, target_dir, num_layers=..., block_size=..., target_layer_ids=..., seed=...)

Targets get the HF layout as the hub ships it (config.json in the classic field spelling,
generation_config.json, model.safetensors or two shards plus model.safetensors.index.json, and a
word-level tokenizer.json on request); drafters the DFlash layout (docs/architecture.md section 7). Weights
are drawn here from the tensor names and shapes alone, independently of the models under test, and
norm weights are random too so a norm applied with the wrong weight shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}
TARGET_DEFAULTS = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 160, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 512, "attention_bias": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _random(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norm weights and biases: around 1, visibly not 1
        return 1.0 + 0.2 * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / shape[-1] ** 0.5


def _layer_shapes(prefix: str, cfg: dict[str, Any], qk_norm: bool) -> dict[str, tuple[int, ...]]:
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        f"{prefix}self_attn.q_proj.weight": (q_rows, hidden),
        f"{prefix}self_attn.k_proj.weight": (kv_rows, hidden),
        f"{prefix}self_attn.v_proj.weight": (kv_rows, hidden),
        f"{prefix}self_attn.o_proj.weight": (hidden, q_rows),
        f"{prefix}input_layernorm.weight": (hidden,),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
    }
    if qk_norm:
        shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
    if cfg.get("attention_bias"):
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows), ("o", hidden)):
            shapes[f"{prefix}self_attn.{name}_proj.bias"] = (rows,)
    return shapes


def _save(directory: Path, tensors: dict[str, torch.Tensor], sharded: bool) -> None:
    if not sharded:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for index, part in enumerate(halves, start=1):
        file = f"model-{index:05d}-of-{len(halves):05d}.safetensors"
        save_file({name: tensors[name] for name in part}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _write_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def write_target_checkpoint(
    directory: str | Path, arch: str = "qwen3", *, tied: bool = False, sharded: bool = False,
    tokenizer: bool = False, seed: int = 0, dtype: str = "float32",
    generation_eos: int | list[int] | None = None, **config: Any,
) -> Path:
    """A random Qwen3 / Llama checkpoint in HF layout; `config` overrides TARGET_DEFAULTS fields."""
    architecture, model_type = ARCHITECTURES[arch]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**TARGET_DEFAULTS, **config}
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"]),
              "model.norm.weight": (cfg["hidden_size"],)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update(_layer_shapes(f"model.layers.{i}.", cfg, qk_norm=arch == "qwen3"))
    if not tied:
        shapes["lm_head.weight"] = (cfg["vocab_size"], cfg["hidden_size"])
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _random(shape, generator).to(DTYPES[dtype]) for name, shape in shapes.items()}
    _save(directory, tensors, sharded)
    config_json = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
                   "tie_word_embeddings": tied, "torch_dtype": dtype, "use_cache": True, **cfg}
    if arch == "llama":
        config_json.update(mlp_bias=False, pretraining_tp=1)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    generation = {"bos_token_id": cfg["bos_token_id"],
                  "eos_token_id": cfg["eos_token_id"] if generation_eos is None else generation_eos}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer:
        _write_tokenizer(directory, cfg["vocab_size"])
    return directory


def write_drafter_checkpoint(
    directory: str | Path, target_dir: str | Path, *, num_layers: int = 2, block_size: int = 8,
    target_layer_ids: list[int] | None = None, mask_token_id: int | None = None, seed: int = 1,
    dtype: str = "float32", **config: Any,
) -> Path:
    """A random DFlash drafter fitting the target in `target_dir`; `config` overrides any field.

    mask_token_id defaults to the target's last vocabulary row (a reserved, untrained row).
    """
    target = json.loads((Path(target_dir) / "config.json").read_text())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    taps = target_layer_ids or [1, target["num_hidden_layers"] - 2]
    mask = target["vocab_size"] - 1 if mask_token_id is None else mask_token_id
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": taps},
        "num_target_layers": target["num_hidden_layers"], "num_hidden_layers": num_layers,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": dtype,
        **{key: target[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                        "max_position_embeddings", "vocab_size")},
        "rope_scaling": None, "attention_bias": False,
    }
    cfg.update(config)
    hidden = cfg["hidden_size"]
    shapes = {"fc.weight": (hidden, len(cfg["dflash_config"]["target_layer_ids"]) * hidden),
              "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update(_layer_shapes(f"layers.{i}.", cfg, qk_norm=True))
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _random(shape, generator).to(DTYPES[dtype]) for name, shape in shapes.items()}
    _save(directory, tensors, sharded=False)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory

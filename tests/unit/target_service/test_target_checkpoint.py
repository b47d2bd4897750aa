"""Loading target checkpoints: layouts, tokenizer, eos ids, dtype, progress, one clear error per bad one."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import target_service.runner.checkpoint as checkpoint_module
from foundation.checkpoint_config import ConfigError
from foundation.weights import CheckpointError
from target_service.runner.checkpoint import load_target, open_target_checkpoint
from tests.tiny_checkpoints import write_target_checkpoint


def test_sharded_and_single_file_checkpoints_load_the_same_weights(tmp_path):
    single = write_target_checkpoint(tmp_path / "single", "llama", seed=8)
    sharded = write_target_checkpoint(tmp_path / "sharded", "llama", sharded=True, seed=8)
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2 and not (sharded / "model.safetensors").exists()
    a, _ = load_target(single, dtype="float32", progress=False)
    b, _ = load_target(sharded, dtype="float32", progress=False)
    tensors = load_file(str(single / "model.safetensors"))
    # fused q/k/v rows are the checkpoint's q, k, v stacked in that order
    qkv = torch.cat([tensors[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(b.layers[2].qkv_proj, qkv)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", ["bf16", "float16", torch.float32])
def test_dtype_is_applied_to_every_parameter(tmp_path, dtype):
    directory = write_target_checkpoint(tmp_path, "qwen3", tied=True)
    model, _ = load_target(directory, dtype=dtype, progress=False)
    expected = {"bf16": torch.bfloat16, "float16": torch.float16}.get(dtype, dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    embed = load_file(str(directory / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_weight, embed.to(expected))


def test_dtype_defaults_to_the_config_and_bad_names_are_refused(tmp_path):
    directory = write_target_checkpoint(tmp_path, "qwen3", dtype="bfloat16")
    model, _ = load_target(directory, progress=False)
    assert model.lm_head_weight.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="dtype 'fp64' is not one of"):
        load_target(directory, dtype="fp64", progress=False)
    with pytest.raises(ConfigError, match=r"dtype torch.int8 is not supported"):
        load_target(directory, dtype=torch.int8, progress=False)


def test_tokenizer_json_is_used_when_present_and_optional_otherwise(tmp_path):
    with_tokenizer = open_target_checkpoint(write_target_checkpoint(tmp_path / "a", "qwen3", tokenizer=True))
    assert with_tokenizer.tokenizer.encode("w5 w17 w3").ids == [5, 17, 3]
    assert open_target_checkpoint(write_target_checkpoint(tmp_path / "b", "qwen3")).tokenizer is None


@pytest.mark.parametrize(("generation_eos", "config_eos", "expected"), [
    ([2, 7], 2, (2, 7)),
    (9, [2, 4], (9, 2, 4)),
    (None, 5, (5,)),
])
def test_eos_ids_come_from_generation_config_then_config(tmp_path, generation_eos, config_eos, expected):
    directory = write_target_checkpoint(tmp_path, "llama", eos_token_id=config_eos)
    if generation_eos is None:
        (directory / "generation_config.json").unlink()
    else:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert open_target_checkpoint(directory).eos_token_ids == expected


def test_loading_progress_is_logged_and_can_be_switched_off(tmp_path, caplog):
    directory = write_target_checkpoint(tmp_path, "qwen3")
    with caplog.at_level(logging.DEBUG, logger="foundation.weights"):
        load_target(directory, dtype="float32")
    percents = [r.getMessage() for r in caplog.records if "%" in r.getMessage()]
    assert percents and percents[-1].endswith("100% (47/47 tensors)")
    done = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(done) == 1 and done[0].startswith(f"loading {directory}: 47 tensors, ")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="foundation.weights"):
        load_target(directory, dtype="float32", progress=False)
    assert not caplog.records


def _edit_tensors(directory, edit):
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def _edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


K_PROJ = "model.layers.0.self_attn.k_proj.weight"
BAD_CHECKPOINTS = {
    "missing tensor": (
        lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        CheckpointError, r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight",
    ),
    "mis-shaped tensor": (
        lambda d: _edit_tensors(d, lambda t: t.update({K_PROJ: torch.zeros(16, 64)})),
        CheckpointError, r"mis-shaped tensors model\.layers\.0\.self_attn\.k_proj\.weight \[16, 64\] "
                         r"\(expected \[32, 64\]\)",
    ),
    "untied without lm_head": (
        lambda d: _edit_tensors(d, lambda t: t.pop("lm_head.weight")),
        CheckpointError, r"missing tensors lm_head",
    ),
    "unknown architecture": (
        lambda d: _edit_config(d, architectures=["MistralForCausalLM"]),
        ConfigError, r"architectures\[0\] 'MistralForCausalLM' is not supported",
    ),
    "unsupported rope scaling": (
        lambda d: _edit_config(d, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        ConfigError, r"config\.json: rope_scaling\.rope_type 'dynamic' is not supported",
    ),
    "eos outside vocabulary": (
        lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [2, 999]}'),
        ConfigError, r"eos_token_id \[999\] outside the vocabulary of 160 tokens",
    ),
    "bad generation config": (
        lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "end"}'),
        ConfigError, r"generation_config\.json: field 'eos_token_id'",
    ),
    "no weights": (
        lambda d: (d / "model.safetensors").unlink(), CheckpointError, r"no model\.safetensors",
    ),
    "broken tokenizer": (
        lambda d: (d / "tokenizer.json").write_text("{"), CheckpointError, r"tokenizer\.json: not a readable",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_fails_with_one_clear_error_before_any_work(tmp_path, monkeypatch, case):
    break_it, error, message = BAD_CHECKPOINTS[case]
    directory = write_target_checkpoint(tmp_path, "qwen3", tokenizer=True)
    break_it(directory)

    def allocate(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was validated")

    monkeypatch.setattr(checkpoint_module, "TargetModel", allocate)
    with pytest.raises(error, match=message):
        load_target(directory, progress=False)


def test_missing_shard_file_is_named(tmp_path):
    directory = write_target_checkpoint(tmp_path, "llama", sharded=True)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lists shard files that do not exist: model-00002-of-00002"):
        open_target_checkpoint(directory)

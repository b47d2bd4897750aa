"""Loading DFlash drafter checkpoints: the fused layout, and one clear error when a drafter does not fit."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import drafter_service.checkpoint as checkpoint_module
from drafter_service.checkpoint import load_drafter
from foundation.checkpoint_config import ConfigError, load_target_config
from foundation.weights import CheckpointError
from tests.tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_target_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")


def test_drafter_tensors_land_in_the_stacked_context_projection(tmp_path, target_dir):
    directory = write_drafter_checkpoint(tmp_path, target_dir, num_layers=3, target_layer_ids=[0, 1, 3])
    drafter = load_drafter(directory, load_target_config(target_dir), dtype="bf16", progress=False)
    saved = load_file(str(directory / "model.safetensors"))
    tensors = {name: t.to(torch.bfloat16) for name, t in saved.items()}
    # kv_proj rows: [k_0; v_0; k_1; v_1; k_2; v_2], so one GEMM projects every layer's context K and V
    stacked = torch.cat([tensors[f"layers.{i}.self_attn.{n}_proj.weight"] for i in range(3) for n in "kv"])
    assert torch.equal(drafter.kv_proj, stacked)
    k_norms = [tensors[f"layers.{i}.self_attn.k_norm.weight"] for i in range(3)]
    assert torch.equal(drafter.k_norm, torch.cat(k_norms))
    assert torch.equal(drafter.fc, tensors["fc.weight"]) and drafter.fc.shape == (64, 192)
    gate_up = torch.cat([tensors["layers.2.mlp.gate_proj.weight"], tensors["layers.2.mlp.up_proj.weight"]])
    assert torch.equal(drafter.layers[2].gate_up_proj, gate_up)
    assert drafter.target_layer_ids == [0, 1, 3] and drafter.block_size == 8 and drafter.mask_token_id == 159


def test_a_drafter_loads_without_a_target_config_too(tmp_path, target_dir):
    drafter = load_drafter(write_drafter_checkpoint(tmp_path, target_dir), progress=False)
    assert drafter.fc.dtype == torch.float32  # the drafter config's torch_dtype


def _drop(directory, name):
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(directory / "model.safetensors"))


def _set_taps(directory, taps):
    config = json.loads((directory / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = taps
    (directory / "config.json").write_text(json.dumps(config))


BAD_DRAFTERS = {  # case: (config fields, how the files are broken afterwards, error, message)
    "hidden size": (
        {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}, None,
        ConfigError, "drafter hidden_size 32 differs from the target's 64",
    ),
    "target layer count": (
        {"num_target_layers": 6}, None,
        ConfigError, "drafter num_target_layers 6 differs from the target's num_hidden_layers 4",
    ),
    "tap outside the target": (
        {"target_layer_ids": [1, 4]}, None,
        ConfigError, r"target_layer_ids \[4\] are outside the target's layers 0..3",
    ),
    "mask token outside the vocabulary": (
        {"mask_token_id": 160}, None,
        ConfigError, "mask_token_id 160 is outside the target's vocabulary of 160",
    ),
    "attention bias": (
        {"attention_bias": True}, None, ConfigError, "'attention_bias': DFlash drafters have no biases",
    ),
    "tap count differs from fc": (
        {}, lambda d: _set_taps(d, [0, 1, 2]),
        CheckpointError, r"mis-shaped tensors fc\.weight \[64, 128\] \(expected \[64, 192\]\)",
    ),
    "missing layer tensor": (
        {}, lambda d: _drop(d, "layers.1.mlp.down_proj.weight"),
        CheckpointError, r"missing tensors layers\.1\.mlp\.down_proj\.weight",
    ),
    "bad rope scaling": (
        {"rope_scaling": {"rope_type": "linear"}}, None,
        ConfigError, r"rope_scaling\.factor must be a positive number",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DRAFTERS))
def test_bad_drafter_fails_with_one_clear_error_before_any_work(tmp_path, monkeypatch, target_dir, case):
    fields, break_it, error, message = BAD_DRAFTERS[case]
    fields = dict(fields)
    kwargs = {key: fields.pop(key) for key in ("target_layer_ids", "mask_token_id") if key in fields}
    directory = write_drafter_checkpoint(tmp_path, target_dir, **kwargs, **fields)
    if break_it:
        break_it(directory)

    def allocate(*args, **kwargs):
        raise AssertionError("the drafter was allocated before the checkpoint was validated")

    monkeypatch.setattr(checkpoint_module, "DFlashDrafter", allocate)
    with pytest.raises(error, match=message):
        load_drafter(directory, load_target_config(target_dir), progress=False)

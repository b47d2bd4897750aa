"""Target and drafter config.json validation: good files load, each bad field is named."""

import json

import pytest

from foundation.checkpoint_config import (
    ConfigError,
    check_drafter_fits,
    default_target_layer_ids,
    load_drafter_config,
    load_target_config,
)

TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 1000, "rope_theta": 1e6, "torch_dtype": "bfloat16", "eos_token_id": [3, 4],
}
DRAFTER = {
    "architectures": ["DFlashDraftModel"], "block_size": 16, "num_target_layers": 8,
    "dflash_config": {"mask_token_id": 999, "target_layer_ids": [1, 3, 5]},
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32,
}


def write(tmp_path, name, data):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def test_directory_and_file_paths_load_the_same(tmp_path):
    folder = write(tmp_path, "t", TARGET)
    by_dir, by_file = load_target_config(folder), load_target_config(folder / "config.json")
    assert by_dir == by_file
    assert by_dir.num_key_value_heads == 2 and by_dir.head_dim == 32 and by_dir.eos_token_ids == [3, 4]


def test_hf_defaults_are_filled(tmp_path):
    data = {k: v for k, v in TARGET.items() if k not in ("num_key_value_heads", "head_dim")}
    config = load_target_config(write(tmp_path, "t", data))
    assert config.num_key_value_heads == 8 and config.head_dim == 256 // 8


def test_newer_rope_parameters_spelling_is_read(tmp_path):
    data = {k: v for k, v in TARGET.items() if k != "rope_theta"}
    data["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    config = load_target_config(write(tmp_path, "t", data))
    assert config.rope_theta == 5e5 and config.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 48}, "head_dim"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"torch_dtype": "int4"}, "torch_dtype"),
        ({"vocab_size": None}, "vocab_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_bad_target_field_is_named(tmp_path, change, field):
    with pytest.raises(ConfigError, match=field) as raised:
        load_target_config(write(tmp_path, "t", {**TARGET, **change}))
    assert "config.json" in str(raised.value)


def test_missing_and_unparseable_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_target_config(tmp_path / "absent")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable as JSON"):
        load_target_config(tmp_path / "bad.json")


def test_drafter_fits_its_target(tmp_path):
    target = load_target_config(write(tmp_path, "t", TARGET))
    drafter = load_drafter_config(write(tmp_path, "d", DRAFTER))
    check_drafter_fits(target, drafter)
    assert drafter.target_layer_ids == [1, 3, 5] and drafter.mask_token_id == 999


@pytest.mark.parametrize(
    "change,words",
    [
        ({"hidden_size": 128, "num_attention_heads": 4}, "hidden_size"),
        ({"num_target_layers": 9}, "num_target_layers"),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 8]}}, "target_layer_ids"),
        ({"dflash_config": {"mask_token_id": 1000}}, "mask_token_id"),
    ],
)
def test_drafter_that_does_not_fit_is_named(tmp_path, change, words):
    target = load_target_config(write(tmp_path, "t", TARGET))
    drafter = load_drafter_config(write(tmp_path, "d", {**DRAFTER, **change}))
    with pytest.raises(ConfigError, match=words):
        check_drafter_fits(target, drafter)


def test_default_taps_follow_the_release_rule():
    # 36 target layers and 5 draft layers give the published Qwen3-8B taps
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(8, 1) == [4]

"""The two `dflash train` commands end to end at tiny sizes: resume, export, CLI errors, the baseline.

The corpus is a few real standard-library files copied into a temporary directory (so the test
does not depend on which Python runs it, and tokenizer training takes a moment).
"""

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_checkpoints import write_target_checkpoint

from dflash_cli.main import main
from drafter_service.checkpoint import load_drafter
from foundation.weights import TensorIndex
from target_service.runner.checkpoint import load_target
from training.corpus import Document, is_held_out, split_documents
from training.evaluate import is_table_like
from training.export import save_sharded
from training.state import ResumeError, checkpoint_path
from training.train_drafter import parse_taps
from training.train_target import TrainTargetArgs, train_target

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# json/scanner.py and colorsys.py are the held-out side of a 40% split
FILES = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py",
         "textwrap.py", "colorsys.py", "bisect.py", "heapq.py", "keyword.py", "fnmatch.py", "glob.py"]
TINY_TARGET = dict(vocab_size=320, layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                   seq_len=32, batch_size=4, warmup_steps=1, held_out_percent=40.0, eval_batches=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name in FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(STDLIB / name, root / name)
    return str(root)


def test_resume_continues_where_it_stopped(corpus, tmp_path):
    straight = train_target(TrainTargetArgs(out=str(tmp_path / "a"), corpus=[corpus], steps=6, **TINY_TARGET))
    first = train_target(TrainTargetArgs(out=str(tmp_path / "b"), corpus=[corpus], steps=6, stop_after=3,
                                         **TINY_TARGET))
    assert (first["step"], first["finished"]) == (3, False)
    assert not (tmp_path / "b" / "config.json").exists()  # nothing exported before the end
    resumed = train_target(TrainTargetArgs(out=str(tmp_path / "b"), corpus=[corpus], steps=6, resume=True,
                                           **TINY_TARGET))
    assert (resumed["step"], resumed["finished"]) == (6, True)
    a = torch.load(checkpoint_path(tmp_path / "a"), weights_only=False)
    b = torch.load(checkpoint_path(tmp_path / "b"), weights_only=False)
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=0, atol=0)  # the same trajectory, bitwise
    assert [r["step"] for r in b["history"]] == [3, 6]  # the curve of both invocations is kept
    assert resumed["held_out_loss"] == pytest.approx(straight["held_out_loss"])
    # a finished run re-exports in another dtype from its fp32 master weights, training nothing
    again = train_target(TrainTargetArgs(out=str(tmp_path / "b"), corpus=[corpus], steps=6, resume=True,
                                         save_dtype="float32", **TINY_TARGET))
    assert again["step"] == 6 and json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == \
        "float32"
    exported = load_file(str(tmp_path / "b" / "model.safetensors"))
    for name, tensor in b["model"].items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)


def test_resume_refuses_a_changed_run(corpus, tmp_path):
    train_target(TrainTargetArgs(out=str(tmp_path), corpus=[corpus], steps=4, stop_after=2, **TINY_TARGET))
    with pytest.raises(ResumeError, match="lr"):
        train_target(TrainTargetArgs(out=str(tmp_path), corpus=[corpus], steps=4, resume=True,
                                     **{**TINY_TARGET, "lr": 1e-4}))
    with pytest.raises(ResumeError, match="no checkpoint"):
        train_target(TrainTargetArgs(out=str(tmp_path / "none"), corpus=[corpus], steps=4, resume=True,
                                     **TINY_TARGET))


def test_train_commands_write_loadable_checkpoints_and_a_lossless_evaluation(corpus, tmp_path, capsys):
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_TARGET.items()]
    assert main(["train", "target", "--out", str(target), "--corpus", corpus, "--steps", "4",
                 "--max-shard-size", "24KiB", *flags]) == 0
    assert len(list(target.glob("model-*.safetensors"))) > 1  # sharded by the size limit
    _, checkpoint = load_target(target, dtype="float32", progress=False)
    assert checkpoint.tokenizer is not None and checkpoint.eos_token_ids == (0,)
    assert main(["train", "drafter", "--target", str(target), "--out", str(drafter), "--corpus", corpus,
                 "--held-out-percent", "40", "--block-size", "4", "--layers", "1", "--seq-len", "32",
                 "--batch-size", "4", "--anchors", "4", "--steps", "3", "--warmup-steps", "1",
                 "--generated", "4", "--prompt-len", "8", "--gen-tokens", "16", "--eval-prompts", "3",
                 "--eval-max-tokens", "12", "--timing-prompts", "1", "--eval-dtype", "float32"]) == 0
    draft = load_drafter(drafter, checkpoint.config, dtype="float32", progress=False)
    assert draft.target_layer_ids == [0, 1] and draft.mask_token_id == 1  # auto taps; the <|mask|> row
    evaluation = json.loads((drafter / "eval.json").read_text())
    assert evaluation["lossless_dflash"] == "3/3" and evaluation["lossless_prompt_lookup"] == "3/3"
    assert evaluation["dflash"]["all"]["num_drafts"] > 0
    summary = json.loads(capsys.readouterr().out.split("\n}\n")[-2] + "\n}")
    assert summary["command"] == "train drafter" and summary["finished"]


@pytest.mark.parametrize("argv, message", [
    (["train", "target", "--heads", "3", "--kv-heads", "2"], "multiple of kv_heads"),
    (["train", "target", "--corpus", "/no/such/dir"], "neither a file nor a directory"),
    (["train", "target", "--warmup-steps", "9", "--steps", "5"], "exceeds steps"),
    (["train", "target", "--max-shard-size", "banana"], "--max-shard-size: cannot read 'banana'"),
    (["train", "drafter", "--target", "/no/such"], "not a checkpoint directory"),
    (["train", "drafter", "--target", "t", "--eval-k", "20"], "block_size - 1"),
    (["train", "drafter", "--target", "t", "--device", "tpu"], "--device: must be cpu, cuda or cuda:N"),
])
def test_bad_train_arguments_exit_2_naming_the_problem_and_write_nothing(argv, message, capsys, tmp_path):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("extra, message", [
    ([], "has no tokenizer.json"),  # found only once the target is open
    (["--mask-token-id", "10000"], "outside the target's vocabulary"),
])
def test_a_drafter_run_refused_after_opening_the_target_leaves_no_output_folder(extra, message, capsys,
                                                                                  tmp_path):
    target = write_target_checkpoint(tmp_path / "target", tokenizer=bool(extra))
    out = tmp_path / "out"
    assert main(["train", "drafter", "--target", str(target), "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_sharded_save_respects_the_limit_and_round_trips(tmp_path):
    tensors = {f"w{i}": torch.randn(16, 8 + i) for i in range(7)}
    files = save_sharded(tensors, tmp_path, max_shard_bytes=1500)
    assert len(files) > 1 and all(f.stat().st_size < 1500 + 1024 for f in files)  # + the header
    index = TensorIndex(tmp_path)
    assert dict(index.read(index.names())).keys() == tensors.keys()
    for name, tensor in index.read(index.names()):
        torch.testing.assert_close(tensor, tensors[name], rtol=0, atol=0)
    save_sharded({"w0": tensors["w0"]}, tmp_path, max_shard_bytes=1500)  # a re-export replaces the shards
    assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert load_file(str(tmp_path / "model.safetensors")).keys() == {"w0"}
    with pytest.raises(ValueError, match="more than max_shard_bytes"):
        save_sharded({"big": torch.zeros(1000)}, tmp_path, max_shard_bytes=100)


def test_table_detection():
    table = "decoding_table = (\n    '\\x00'  #  0x00 -> NULL\n    '\\x01'  #  0x01\n    0x41, 0x42,\n)\n"
    code = "def f(x):\n    if x > 1:\n        return g(x) + 1\n    return 0\n"
    assert is_table_like(table) and not is_table_like(code) and not is_table_like("")


def test_auto_taps_reach_the_last_layer_and_bad_taps_are_refused():
    assert parse_taps("auto", 6, 2) == [1, 3, 5]
    assert parse_taps("auto", 2, 1) == [0, 1]
    assert parse_taps("auto", 12, 5) == [1, 4, 6, 8, 11]
    assert parse_taps("0,4", 6, 2) == [0, 4]
    for bad in ("6", "1,1", "a", ""):
        with pytest.raises(ValueError, match="--taps"):
            parse_taps(bad, 6, 2)


def test_split_is_by_whole_file_and_near_the_asked_fraction():
    names = [f"pkg{i // 10}/mod{i}.py" for i in range(2000)]
    documents = [Document(name, "x = 1\n") for name in names]
    train, held = split_documents(documents, 5.0)
    assert {d.name for d in train}.isdisjoint({d.name for d in held})
    assert len(train) + len(held) == len(names) and 0.03 < len(held) / len(names) < 0.07
    assert [is_held_out(n, 5.0) for n in names] == [is_held_out(n, 5.0) for n in names]  # stable
    assert {d.name for d in held} <= {d.name for d in split_documents(documents, 20.0)[1]}  # nested

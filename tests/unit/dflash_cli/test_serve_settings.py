"""dflash serve's start-up settings for a fresh server: the compile cache every replica uses (a
writable absolute directory, handed to the replicas' processes as TRITON_CACHE_DIR) and the prefill
budget beside decodes (0: no cap) reach ServeArgs, EngineArgs and the deployment; a bad value is one
line naming the flag."""

from __future__ import annotations

import argparse
import os

import pytest

import dflash_cli.main as cli
from dflash_cli.serve import register, serve_args


def parsed(*argv: str):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return serve_args(parser.parse_args(["serve", "--device", "cpu", *argv]))


def test_the_compile_cache_reaches_every_replica_as_its_triton_cache_dir(tmp_path):
    from target_service.serving.deploy import replica_deployment

    directory = tmp_path / "cache" / "triton"  # created when missing
    args = parsed("--compile-cache-dir", str(directory))
    assert args.compile_cache_dir == str(directory) and directory.is_dir()
    options = replica_deployment(args).ray_actor_options
    assert options["runtime_env"] == {"env_vars": {"TRITON_CACHE_DIR": str(directory)}}
    assert "runtime_env" not in replica_deployment(parsed()).ray_actor_options


def test_a_relative_compile_cache_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parsed("--compile-cache-dir", "kept").compile_cache_dir == os.path.join(str(tmp_path), "kept")


@pytest.mark.parametrize("cap, expected", [(None, None), ("0", None), ("64", 64)])
def test_the_prefill_budget_beside_decodes_reaches_the_engine(cap, expected):
    args = parsed(*(() if cap is None else ("--max-prefill-tokens-with-decodes", cap)),
                  "--max-num-batched-tokens", "1024")
    engine = args.engine_args()
    assert (engine.max_prefill_tokens_with_decodes, engine.max_num_batched_tokens) == (expected, 1024)


@pytest.mark.parametrize("argv, expected", [
    (("--compile-cache-dir", "{file}/triton"), "--compile-cache-dir: cannot write to {file}/triton (Not a "
                                               "directory)"),
    (("--max-prefill-tokens-with-decodes", "-2"), "--max-prefill-tokens-with-decodes: Input should be "
                                                  "greater than or equal to 1, got -2"),
    (("--max-num-batched-tokens", "8"), "--max-num-batched-tokens: Input should be greater than or equal "
                                        "to 16, got 8"),
])
def test_bad_values_are_one_line_naming_the_flag(tmp_path, capsys, argv, expected):
    file = tmp_path / "a-file"  # a directory under a file: refused even for root
    file.write_text("")
    code = cli.main(["serve", *(arg.format(file=file) for arg in argv)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dflash serve: error: " + expected.format(file=file)), err


@pytest.mark.parametrize("level", [None, "summary", "detailed"])
def test_the_per_request_spec_decode_metrics_level_reaches_serve_args(level):
    argv = () if level is None else ("--per-request-spec-decode-metrics", level)
    assert parsed(*argv).per_request_spec_decode_metrics == level  # None, the default: off


def test_an_unknown_spec_decode_metrics_level_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's refusal of a choice, in the one-line parser
        cli.main(["serve", "--per-request-spec-decode-metrics", "full"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dflash serve: error: argument --per-request-spec-decode-metrics: invalid choice: "
                          "'full' (choose from 'summary', 'detailed')"), err

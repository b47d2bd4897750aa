"""Every mistake a new user makes in the first hour is one line, `dflash <cmd>: error: <flag>: ...`,
exit status 2, naming the flag (or the field) and what would be right; none is a traceback."""

from __future__ import annotations

import re
import shutil
import socket

import pytest
from cli_output import without_sweep_reports
from tiers import ROOT
from tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

import dflash_cli.main as cli
from dflash_cli.flags import attach_dash_values

EXAMPLES = ("--target", str(ROOT / "examples" / "qwen3-8b"),
            "--drafter", str(ROOT / "examples" / "qwen3-8b-dflash-b16"))
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target of 4,096 positions and its drafter."""
    root = tmp_path_factory.mktemp("pair")
    target = write_target_checkpoint(root / "target", max_position_embeddings=4096)
    return str(target), str(write_drafter_checkpoint(root / "drafter", target))


@pytest.fixture
def dflash(capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_KVPOOL_TOKEN", raising=False)

    def run(*argv: str) -> tuple[int, str]:
        code = cli.main([str(a) for a in argv])
        err = without_sweep_reports(capsys.readouterr().err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return code, err.strip()
    return run


def test_a_pool_larger_than_shared_memory_names_memory_and_what_is_free(dflash):
    free = shutil.disk_usage("/dev/shm").free
    assert free < 10 * 2**40  # the premise: no machine here has 10 TiB of /dev/shm
    code, err = dflash("kvpool", *EXAMPLES, "--memory", "10TiB", "--device", "cpu", "--port", "0")
    assert code == 2
    assert err.startswith("dflash kvpool: error: --memory 10TiB does not fit in /dev/shm: ")
    number, unit = re.search(r"/dev/shm: ([0-9.]+) (\w+) free there", err).groups()
    assert abs(float(number) * UNITS[unit] - free) < 2**30  # what is free (other tests may take some)


def test_a_port_in_use_names_port(dflash):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = dflash("kvpool", *EXAMPLES, "--memory", "64MiB", "--device", "cpu", "--port", port)
    assert code == 2
    assert err.startswith(f"dflash kvpool: error: --port {port}: cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize("argv, expected", [
    (("generate", "--prompt-ids", "1,2", "--device", "tpu"),
     "dflash generate: error: --device: must be cpu, cuda or cuda:N, got 'tpu'"),
    (("generate", "--prompt-ids", "1,2", "--kv-cache-memory", "banana"),
     "dflash generate: error: --kv-cache-memory: cannot read 'banana' as a size"),
    (("generate", "--prompt-ids", "1,2", "--kv-cache-memory", "-5GiB"),
     "dflash generate: error: --kv-cache-memory: size '-5GiB' must be a positive"),
    (("generate", "--prompt-ids", "1,2", "--max-model-len", "100000"),
     "dflash generate: error: max_model_len 100000 exceeds the target's max_position_embeddings 4096"),
    (("generate", "--prompt-ids", "1,2", "-k", "-3"),
     "dflash generate: error: --num-speculative-tokens: Input should be greater than or equal to 1, got -3"),
])
def test_generate_refuses_bad_values_naming_the_flag(dflash, pair, argv, expected):
    target, drafter = pair
    code, err = dflash(*argv, "--target", target, "--drafter", drafter)
    assert code == 2 and err.startswith(expected), err


@pytest.mark.parametrize("command", ["plan", "kvpool"])
def test_a_negative_memory_reaches_validation(dflash, command):
    extra = ("--max-model-len", "4096", "--max-num-seqs", "8") if command == "plan" else ("--device", "cpu")
    code, err = dflash(command, *EXAMPLES, "--memory", "-5GiB", *extra)
    assert code == 2
    assert err == f"dflash {command}: error: --memory: size '-5GiB' must be a positive whole number of bytes"


def test_kvpool_refuses_an_unknown_device(dflash):
    code, err = dflash("kvpool", *EXAMPLES, "--memory", "64MiB", "--device", "tpu")
    assert code == 2 and err == "dflash kvpool: error: --device: must be cpu, cuda or cuda:N, got 'tpu'"


def test_a_gpu_this_machine_lacks_is_refused(dflash, pair):
    # without CUDA: "... but CUDA is not available"; with fewer GPUs: "... but this machine has N"
    code, err = dflash("kvpool", *EXAMPLES, "--memory", "64MiB", "--device", "cuda:99")
    assert code == 2 and err.startswith("dflash kvpool: error: --device: device 'cuda:99' was asked for but")
    target, drafter = pair
    code, err = dflash("generate", "--prompt-ids", "1,2", "--target", target, "--drafter", drafter,
                       "--device", "cuda:99")
    assert code == 2 and err.startswith("dflash generate: error: device 'cuda:99' was asked for but")


@pytest.mark.parametrize("command", [("generate", "--prompt-ids", "1,2"), ("serve",), ("plan", *EXAMPLES)])
def test_an_unknown_cache_dtype_is_one_line_naming_the_flag(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--kv-cache-dtype", "int4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"dflash {command[0]}: error: argument --kv-cache-dtype: invalid choice: 'int4'")


def test_argparse_mistakes_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--memory", "1GiB"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("dflash plan: error: the following arguments are required: --target, --drafter")


@pytest.mark.parametrize("argv, expected", [
    (["plan", "--memory", "-5GiB"], ["plan", "--memory=-5GiB"]),
    (["generate", "-k", "-3", "p"], ["generate", "-k=-3", "p"]),
    (["plan", "--memory", "--json"], ["plan", "--memory", "--json"]),  # a flag stays a flag
    (["generate", "--device", "-v"], ["generate", "--device", "-v"]),  # a short flag too
    (["plan", "--json", "-5"], ["plan", "--json", "-5"]),  # --json takes no value
    (["generate", "--", "--max-tokens", "-5"], ["generate", "--", "--max-tokens", "-5"]),  # after --: words
])
def test_dash_values_are_attached_to_their_flag_only(argv, expected):
    assert attach_dash_values(cli.build_parser(), argv) == expected


@pytest.mark.parametrize(("argv", "expected"), [
    (["--port", "70000"], "--port: "),
    (["--replicas", "0"], "--replicas: "),
    (["--kv-cache-memory", "banana"], "--kv-cache-memory: "),
    (["--device", "tpu"], "--device: "),
    (["--api-key-file", "/no/such/key"], "--api-key-file: /no/such/key is not a readable file"),
    (["--max-waiting", "-1"], "--max-waiting: "),
])
def test_serve_refuses_bad_flags_before_starting_anything(dflash, argv, expected, monkeypatch):
    import target_service.serving.deploy as deploy

    monkeypatch.setattr(deploy, "start_ray", lambda settings: pytest.fail("Ray was started"))
    code, err = dflash("serve", *argv)
    assert code == 2 and err.startswith(f"dflash serve: error: {expected}"), err


@pytest.mark.parametrize("argv,expected", [([], True), (["--no-async-scheduling"], False)])
def test_serve_async_scheduling_flag_reaches_the_engine_args(argv, expected):
    from dflash_cli.main import build_parser
    from dflash_cli.serve import serve_args

    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    settings = serve_args(args)
    assert settings.async_scheduling is expected and settings.engine_args().async_scheduling is expected


@pytest.mark.parametrize("argv,expected", [([], "auto"), (["--kv-cache-dtype", "fp8"], "fp8")])
def test_serve_kv_cache_dtype_flag_reaches_the_engine_args(argv, expected):
    from dflash_cli.main import build_parser
    from dflash_cli.serve import serve_args

    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    assert serve_args(args).engine_args().kv_cache_dtype == expected

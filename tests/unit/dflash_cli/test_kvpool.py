"""`dflash kvpool` as a real process, read by `dflash admin stats|health`; bad flags exit cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_output import without_sweep_reports
from tiers import ROOT

import dflash_cli.main as cli

TARGET, DRAFTER = ROOT / "examples" / "qwen3-8b", ROOT / "examples" / "qwen3-8b-dflash-b16"
MODULES = ("dflash_cli.kvpool", "dflash_cli.admin")
# The dispatcher with these subcommands, whether or not cli.py lists them yet.
RUNNER = ("import sys, dflash_cli.main as cli; "
          f"cli.SUBCOMMAND_MODULES = tuple(dict.fromkeys(cli.SUBCOMMAND_MODULES + {MODULES!r})); "
          "sys.exit(cli.main(sys.argv[1:]))")


@pytest.fixture
def dflash(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", tuple(dict.fromkeys(cli.SUBCOMMAND_MODULES + MODULES)))
    monkeypatch.delenv("DFLASH_KVPOOL_TOKEN", raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, without_sweep_reports(err)
    return run


def expected_blocks(memory: int, tokens_per_block: int = 32) -> tuple[int, int, int]:
    """(target bytes/token, draft bytes/token, blocks) from the raw config.json files, by hand."""
    def kv_bytes(path: Path) -> int:
        config = json.loads((path / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # bf16
    target, draft = kv_bytes(TARGET), kv_bytes(DRAFTER)
    return target, draft, memory // (tokens_per_block * (target + draft))


def read_line(stream, timeout: float) -> str:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


def dflash_process(*argv, **popen) -> subprocess.Popen:
    """`dflash *argv` as its own process, stdout and stderr piped unless `popen` says otherwise."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, "-c", RUNNER, *map(str, argv)], text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)


def start_pool(*flags) -> tuple[subprocess.Popen, str]:
    """A `dflash kvpool` on any free port, and its address once it listens."""
    process = dflash_process("kvpool", "--target", TARGET, "--drafter", DRAFTER, "--memory", "64MiB",
                             "--port", "0", *flags)
    line = read_line(process.stdout, timeout=60)
    if not line.startswith("kvpool listening on 127.0.0.1:"):
        process.kill()
        pytest.fail(f"no pool: {line!r}, exit {process.wait()}: {process.stderr.read()}")
    return process, line.split()[3]


def test_kvpool_serves_until_sigterm_and_admin_reads_it(dflash, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    process, address = start_pool("--token-file", token_file, "--max-num-seqs", "8")
    try:
        code, out, _ = dflash("admin", "stats", "--address", address, "--token-file", token_file, "--json")
        assert code == 0
        stats = json.loads(out)
        target_bpt, draft_bpt, num_blocks = expected_blocks(64 * 2**20)
        assert [(g["name"], g["num_blocks"], g["num_free_blocks"], g["bytes_per_token"])
                for g in stats["groups"]] == [("target", num_blocks, num_blocks, target_bpt),
                                              ("draft", num_blocks, num_blocks, draft_bpt)]
        assert stats["num_seqs"] == 0 and stats["tokens_per_block"] == 32 and stats["epoch"] > 0
        code, out, _ = dflash("admin", "stats", "--address", address, "--token-file", token_file)
        assert code == 0 and f"target  {num_blocks:>6}" in out and "prefix-cache hit rate 0.0%" in out
        code, out, _ = dflash("admin", "health", "--address", address, "--json")  # health needs no token
        assert code == 0 and json.loads(out) == {"server": "SERVING", "dflash.kvpool.v1.KVPool": "SERVING"}
        code, _, err = dflash("admin", "stats", "--address", address)
        assert code == 1 and "missing bearer token" in err and len(err.strip().splitlines()) == 1
        shm_files = list(Path("/dev/shm").glob(f"dflash-pool-{process.pid}-*"))
        assert len(shm_files) == 1  # the pool memory: host memory on a machine without a GPU
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0, process.stderr.read()
    assert not shm_files[0].exists()


def test_bad_flags_exit_with_one_sentence(dflash, tmp_path):
    common = ("kvpool", "--target", TARGET, "--drafter", DRAFTER)
    cases = [
        ((*common, "--memory", "1KiB"), 2, "holds no block: one block of 32 tokens takes"),
        ((*common, "--memory", "64MiB", "--port", "70000"), 2, "--port must be in 0..65535"),
        ((*common, "--memory", "lots"), 2, "cannot read 'lots' as a size"),
        ((*common, "--memory", "64MiB", "--token-file", tmp_path / "none"), 2, "cannot read the token file"),
        (("admin", "stats", "--address", "localhost"), 2, "--address must be HOST:PORT"),
        (("admin", "health", "--address", "127.0.0.1:1", "--timeout", "2"), 1,
         "cannot reach the pool at 127.0.0.1:1"),
    ]
    for argv, want_code, words in cases:
        code, _, err = dflash(*argv)
        assert code == want_code and words in err, (argv, code, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_second_pool_on_the_same_port_is_refused_naming_port():
    """gRPC binds with SO_REUSEPORT by default: without turning it off, this second pool would serve too.
    A file of a dead owner lies in /dev/shm (as a killed pool of another test leaves one): the second
    pool's start-up removes it and says so, and the error is still the one line after that report."""
    first, address = start_pool()
    orphan = Path("/dev/shm") / f"dflash-pool-999999999-{os.urandom(8).hex()}"
    orphan.write_bytes(b"")  # nobody holds its lock
    try:
        port = address.rsplit(":", 1)[1]
        second = dflash_process("kvpool", "--target", TARGET, "--drafter", DRAFTER, "--memory", "64MiB",
                                "--port", port)
        try:
            _, everything = second.communicate(timeout=60)
            err = without_sweep_reports(everything)
        except subprocess.TimeoutExpired:
            second.kill()
            pytest.fail("the second pool is serving on a port already in use")
        assert second.returncode == 2
        assert err.startswith(f"dflash kvpool: error: --port {port}: cannot listen on 127.0.0.1:{port}")
        assert len(err.strip().splitlines()) == 1, err  # gRPC's own log line is not shown either
        assert not orphan.exists()  # removed, and reported above the error (or by another test's pool)
    finally:
        orphan.unlink(missing_ok=True)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)


def test_admin_stats_into_a_reader_that_left_exits_quietly():
    """`dflash admin stats | head -2`, where head is gone before anything is written: exit 141 (what a
    shell shows for SIGPIPE), no traceback, no "Exception ignored" at interpreter exit."""
    pool, address = start_pool()
    try:
        reader, writer = os.pipe()
        os.close(reader)  # the reader has left
        stats = dflash_process("admin", "stats", "--address", address, stdout=writer)
        os.close(writer)
        err = stats.stderr.read()
        assert stats.wait(timeout=60) == 141, err
        assert err == ""
    finally:
        pool.send_signal(signal.SIGTERM)
        pool.wait(timeout=30)


def test_token_file_help_says_the_variable_holds_the_token_itself(dflash, monkeypatch, capsys):
    from foundation.secret_file import POOL_TOKEN_ENV as TOKEN_ENV
    from foundation.secret_file import load_secret

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert load_secret(None, env=TOKEN_ENV) == "s3cret"  # the variable is the token, not a path
    for argv in (["kvpool", "--help"], ["admin", "stats", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert f"the token itself in ${TOKEN_ENV}" in text, text

"""The committed generated code matches protos/, and the check notices when it does not."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from tiers import ROOT

spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "protos" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)

PROTO = "dflash/kvpool/v1/kvpool.proto"


def test_committed_generated_code_is_current():
    assert generate.stale_files() == [], "run `python protos/generate.py` and commit kvpool_service/proto"


def test_check_fails_when_the_proto_changes(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos)
    path = protos / PROTO
    path.write_text(path.read_text().replace("  uint32 max_model_len = 7;\n",
                                             "  uint32 max_model_len = 7;\n  uint32 extra = 99;\n"))
    stale = generate.stale_files(proto_root=protos)
    assert "kvpool_pb2.py" in stale and "kvpool_pb2.pyi" in stale


def test_check_notices_edited_missing_and_extra_files(tmp_path):
    out = tmp_path / "proto"
    generate.write(out_dir=out)
    assert generate.stale_files(out_dir=out) == []
    (out / "kvpool_pb2_grpc.py").write_text("# edited by hand\n")
    (out / "kvpool_pb2.pyi").unlink()
    (out / "old_pb2.py").write_text("")
    assert generate.stale_files(out_dir=out) == ["kvpool_pb2.pyi", "kvpool_pb2_grpc.py", "old_pb2.py"]


def test_check_command_exit_status():
    result = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_broken_proto_is_an_error(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos)
    (protos / PROTO).write_text("syntax = \"proto3\"; message {")
    with pytest.raises(RuntimeError, match="protoc failed"):
        generate.generate(protos)

"""The image's Dockerfile and build context, read as text (no Docker engine runs here): a pinned CUDA
base, the package installed from the repository, a non-root user, no secret, the two ports."""

from __future__ import annotations

import re

from tests.k8s.kustomize_render import split_image
from tests.k8s.manifests import ROOT, looks_like_secret, names_a_secret

DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [line.strip() for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def _instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in INSTRUCTIONS if line.split(None, 1)[0].upper() == name]


def test_base_image_is_a_pinned_cuda_runtime():
    (base,) = _instructions("FROM")
    name, tag, _ = split_image(base)
    assert name == "nvidia/cuda"
    assert tag and tag != "latest" and re.fullmatch(r"\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", tag)


def test_installs_the_package_from_the_repository_with_every_package_copied():
    assert any(re.search(r"pip install .* \.(\s|$)", run) for run in _instructions("RUN"))
    # [tool.setuptools.packages.find] include = ["kernels*", ...]
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    packages = [pattern.strip('" *') for pattern in include.group(1).split(",")]
    copied = {line.split()[0] for line in _instructions("COPY")}
    assert set(packages) <= copied
    assert {"pyproject.toml", "README.md"} <= set(" ".join(_instructions("COPY")).split())


def test_the_image_carries_no_bench_scripts():
    # what `dflash bench` runs is dflash_cli/bench, installed with the package; bench/ is the lab notebook
    copied = {line.split()[0] for line in _instructions("COPY")}
    assert "bench" not in copied and "bench*" not in (ROOT / "pyproject.toml").read_text()
    assert "dflash_cli" in copied and (ROOT / "dflash_cli" / "bench" / "__init__.py").is_file()


def test_runs_as_a_non_root_numeric_user():
    user = _instructions("USER")[-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: the kubelet can check runAsNonRoot


def test_exposes_the_http_and_admin_ports():
    assert {"8000", "50051"} <= set(" ".join(_instructions("EXPOSE")).split())


def test_bakes_in_no_secret():
    for line in _instructions("ENV") + _instructions("ARG"):
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", line) or [line.split("=")[0].split()[0]]:
            assert not names_a_secret(name), line
    assert not looks_like_secret(DOCKERFILE)


def test_build_context_leaves_out_the_venv_git_bench_and_keys():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "bench", "**/*.key"} <= ignored  # bench/ holds bench/results/

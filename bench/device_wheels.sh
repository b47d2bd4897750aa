#!/usr/bin/env bash
# The wheels the H200 scripts carry (".whl" is git-ignored: a fresh checkout has none; run this once
# before the first device call). The device image has torch, triton and numpy for Python 3.12 but not
# the server's own packages: .whl/ gets those (gRPC with its health and reflection services, protobuf,
# pydantic, the HTTP stack, the metrics client, llguidance for structured outputs, jsonschema for their tests); .whl/fuzz/ gets schemathesis and everything it needs
# (bench/fuzz_h200.sh installs it apart from the image's packages). About 30 MB in all, within the
# carry limit.
#
#   bash bench/device_wheels.sh [PYTHON]   (PYTHON: one with pip, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
download() {
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 "$@"
}
mkdir -p .whl/fuzz
download --no-deps -d .whl "grpcio==1.85.1" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" \
    "protobuf>=7.35.1,<8" "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection \
    "typing-extensions>=4.16" "fastapi==0.165.*" "opentelemetry-api==1.45.*" "starlette==1.10.*" "uvicorn==0.55.*" h11 annotated-doc click \
    prometheus-client httpx httpcore anyio sniffio idna certifi tqdm "llguidance>=1.9,<2" \
    jsonschema jsonschema-specifications referencing rpds-py
download -d .whl/fuzz "schemathesis==4.32.5"
ls .whl/*.whl | wc -l | xargs echo "server wheels:"
ls .whl/fuzz/*.whl | wc -l | xargs echo "fuzz wheels:"
du -sh .whl

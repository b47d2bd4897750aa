#!/usr/bin/env bash
# The service split on one H200 (bench/bench_services_split.py, Qwen3-8B geometry): one device call.
# Carry [".devray", ".whl"]: a core-only Ray (../shared/tools/device_ray.sh; its binaries stripped of
# symbols to fit the carry limit beside the demo pair) and the pydantic / gRPC wheels the image lacks.
#   bash bench/services_split_h200.sh [more flags for bench.bench_services_split]
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p /tmp/site "$OUT"
tar -xJf .devray/ray-slim.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devray/*.whl .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
    RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
python3 -c 'import ray, grpc, pydantic, torch; print("ray", ray.__version__, "torch", torch.__version__)'
timeout 500 python3 -m bench.bench_services_split --steps 16 --rounds 3 --batch-sizes 1 32 --context 2048 \
    --out "$OUT" --name services_split_h200 "$@" 2>&1 | grep -v "^\s*$" | tail -80

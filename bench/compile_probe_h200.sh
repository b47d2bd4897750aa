#!/usr/bin/env bash
# What compiles after start-up on one H200, from an empty Triton cache: `bench.compile_probe` (the
# in-process engine, Qwen3-8B shapes, plain and DFlash, bf16 and fp8 caches, under a randomised
# workload), then, with GPU_TESTS=1, the GPU-marked tests once. One device call; carry [".whl"]
# (bench/device_wheels.sh makes it).
#
#   OUT=DIR bash bench/compile_probe_h200.sh [flags for bench.compile_probe]
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p /tmp/site "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR
TRITON_CACHE_DIR=$(mktemp -d)
timeout "${LIMIT:-300}" python3 -m bench.compile_probe --out "$OUT" "$@" > "$OUT/compile_probe.log" 2>&1
echo "probe: exit $?"; grep -v "^\s*$" "$OUT/compile_probe.log" | tail -n 60
# start-up again over the cache the first run filled: what a pod that keeps its compile cache meets
timeout 120 python3 -m bench.compile_probe --out "$OUT/warm_cache" --configs dflash:auto --requests 8 \
    > "$OUT/compile_probe_warm_cache.log" 2>&1
echo "probe, warm cache: exit $?"; tail -n 3 "$OUT/compile_probe_warm_cache.log"
if [ "${GPU_TESTS:-0}" = 1 ]; then
    OUT=$OUT RUNS=1 RUN_LIMIT_S=${RUN_LIMIT_S:-240} TEST_TIMEOUT_S=150 bash tests/run_gpu_tests.sh
fi

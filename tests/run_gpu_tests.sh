#!/usr/bin/env bash
# The GPU-marked tests on one CUDA machine, RUNS times in a row (default 3): each run's log names every
# test (-v), a test that hangs past TEST_TIMEOUT_S is failed with every thread's stack dumped, and the
# slowest ten are listed. The image lacks pydantic and gRPC's extras: carry .whl (pydantic, grpcio with
# its health and reflection wheels, protobuf; for the machine's Python) and they are installed first.
#
#   OUT=DIR RUNS=3 bash tests/run_gpu_tests.sh [more pytest arguments]
#
# Carry .devray too (a core-only Ray, ../shared/tools/device_ray.sh) and the Ray services' GPU tests run.
# COLD=1 empties Triton's cache first, so the first run compiles every kernel it reaches, as on a
# fresh machine (the first run's time is then mostly compiling).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_tests}
RUNS=${RUNS:-3}
mkdir -p "$OUT"
if [ -f .devray/ray-slim.tar.xz ]; then  # a core-only Ray (../shared/tools/device_ray.sh): the Ray services' GPU tests
    mkdir -p /tmp/site && tar -xJf .devray/ray-slim.tar.xz -C /tmp/site || exit 1
    export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
fi
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl $(for w in .devray/*.whl; do [ -f "$w" ] && [ ! -f ".whl/${w##*/}" ] && echo "$w"; done) \
        || exit 1  # a wheel in both folders once: pip refuses a package named twice
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                                       torch.cuda.get_device_name())' | tee "$OUT/gpu_tests_env.txt"
# The tiers that hold GPU tests and need no HTTP stack (the Ray services' skip themselves without Ray).
SUITES="tests/unit/kernels tests/unit/foundation tests/unit/kvpool_service tests/unit/target_service
        tests/engine tests/multiprocess"
if [ "${COLD:-0}" = 1 ]; then
    rm -rf "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
fi
for run in $(seq 1 "$RUNS"); do
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${RUN_LIMIT_S:-420}" python3 -m pytest -v -ra -m gpu -p no:cacheprovider \
        --timeout "${TEST_TIMEOUT_S:-120}" --durations 10 $SUITES "$@" > "$OUT/gpu_tests_run$run.log" 2>&1
    code=$?
    echo "run $run: exit $code after $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/gpu_tests_run$run.log")"
done

#!/usr/bin/env bash
# The service split on one H200 (bench/bench_services_split.py, Qwen3-8B geometry): one device call.
# Carry [".devray", ".whl"]: a core-only Ray (.devray/ray-slim.tar.xz and its wheels, binaries stripped
# of symbols to fit the carry limit beside the demo pair) and the pydantic / gRPC wheels the image lacks.
#   bash bench/services_split_h200.sh [more flags for bench.bench_services_split]
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p /tmp/site "$OUT"
tar -xJf .devray/ray-slim.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devray/*.whl .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
    PYTHONUNBUFFERED=1
cp bench/device_sitecustomize.py /tmp/site/sitecustomize.py  # INFO logs and stack dumps in every process
python3 -c 'import ray, grpc, pydantic, torch; print("ray", ray.__version__, "torch", torch.__version__)'
LIMIT=${LIMIT:-440}
python3 -m bench.bench_services_split --steps 16 --rounds 3 --batch-sizes 1 32 --context 2048 \
    --out "$OUT" --name services_split_h200 "$@" > "$OUT/services_split.log" 2>&1 &
BENCH=$!
for _ in $(seq "$LIMIT"); do kill -0 $BENCH 2> /dev/null || break; sleep 1; done
if kill -0 $BENCH 2> /dev/null; then  # stuck: every process's Python stacks into the logs, then stop
    pkill -USR1 -f "ray::" ; kill -USR1 $BENCH; sleep 3; kill $BENCH
    tail -n 60 /tmp/ray/session_latest/logs/worker-*.err > "$OUT/ray_workers.txt" 2>&1
fi
wait $BENCH
tail -n 40 "$OUT/services_split.log"

#!/usr/bin/env bash
# Issue 31's table on one H200: `bench.fresh_server` (dflash serve's app over one replica, Qwen3-8B
# geometry, random bf16 weights) for plain and DFlash decoding, each in a process of its own from an
# empty Triton cache, then DFlash once more over the cache its first run filled (what a pod that keeps
# its compile cache meets). One device call; carry [".whl"] (pydantic, gRPC, fastapi, uvicorn, httpx,
# prometheus_client: wheels for the machine's Python 3.12, installed to /tmp/site; bench/device_wheels.sh makes them).
#
#   OUT=DIR bash bench/fresh_server_h200.sh [flags for bench.fresh_server, e.g. --concurrency 8 32]
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p /tmp/site "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for mode in plain dflash; do
    cache=$(mktemp -d)
    TRITON_CACHE_DIR=$cache timeout "${LIMIT:-240}" python3 -m bench.fresh_server --mode "$mode" --out "$OUT" "$@" \
        > "$OUT/fresh_server_$mode.log" 2>&1
    echo "$mode: exit $?"; grep -E '^\{|^\| concurrency' "$OUT/fresh_server_$mode.log" "$OUT/fresh_server_$mode.md" | tail -n 12
done
TRITON_CACHE_DIR=$cache timeout "${LIMIT:-240}" python3 -m bench.fresh_server --mode dflash --out "$OUT" \
    --name fresh_server_dflash_kept_cache "$@" > "$OUT/fresh_server_dflash_kept_cache.log" 2>&1
echo "dflash over the kept cache: exit $?"; grep -E '^\{' "$OUT/fresh_server_dflash_kept_cache.log" | tail -n 2

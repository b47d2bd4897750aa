#!/usr/bin/env bash
# Issue 34 on a GPU in one device call: what the hybrid costs beyond prompt lookup, on the demo pair
# (host-bound steps) and on the Qwen3-8B geometry (GPU-bound steps, acceptance simulated).
#
#   OUT=$OUT bash bench/device_pack.sh bench/token_proposers_gpu.sh      # carry [".whl"]
#
# 1. `bench.hybrid_overhead`: ngram, the hybrid pinned to the lookup, and the free hybrid on the demo
#    pair's prompt classes (the pinned hybrid against ngram: the hybrid's per-step cost alone);
# 2. `dflash_cli.bench.step --modes dflash ngram hybrid-lookup hybrid` on the 8B geometry: the same
#    comparison where a step is ~7 ms of GPU work.
# Each is cut at LIMIT seconds (default 200) and keeps what it measured; results and logs go to $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the device image lacks pydantic and gRPC
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${LIMIT:-200}" python3 -m bench.hybrid_overhead --device cuda --rounds 4 \
    --out "$OUT/hybrid_overhead_gpu.md" > "$OUT/hybrid_overhead.log" 2>&1
echo "hybrid_overhead: exit $?"
sed -n '/^| class/,$p' "$OUT/hybrid_overhead_gpu.md" 2>/dev/null
timeout "${LIMIT:-200}" python3 -m dflash_cli.bench.step --modes dflash ngram hybrid-lookup hybrid \
    --batch-sizes 1 8 32 --contexts 2048 --steps 32 --rounds 2 --no-hf --num-speculative-tokens 15 \
    --out "$OUT" --name token_proposers_8b > "$OUT/token_proposers_8b.log" 2>&1
echo "step bench: exit $?"
sed -n '/^| mode/,/^$/p' "$OUT/token_proposers_8b.md" 2>/dev/null

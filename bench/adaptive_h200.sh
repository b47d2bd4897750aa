#!/usr/bin/env bash
# Issue 33: adaptive speculation against a fixed K on one H200 (Qwen3-8B geometry, random weights,
# acceptance simulated from one per-position curve). One device call; carry [".whl"].
#
#   OUT=$OUT bash bench/adaptive_h200.sh [flags for dflash_cli.bench.step; later flags win]
#
# Three step benches one after the other on the same machine, the same cases and the same simulated
# acceptance (a geometric curve whose 15 drafts give a mean acceptance length of MEAN, default 6.5 as
# in the goal): K 15
# fixed, K 7 fixed, and K 15 with adaptive speculation (each step verifies 0, 1, 3, 7 or 15). A
# fixed K 7 verifies what its curve's first 7 positions accept, so the three see the same drafter.
# 32 timed steps a case: the adaptive engine tries each of its five choices once where it could win
# before its measurements decide, and those first steps should not be most of what is timed. Each
# case's JSON holds the steps it verified at each k (decode_steps_by_drafts).
# Each run is cut at LIMIT seconds (default 170) and keeps what it measured (the bench saves after
# every case); logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
MEAN=${MEAN:-6.5}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the device image lacks pydantic and gRPC
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
# Plain decode is timed once, in the first run, as the floor the three are read against.
for run in "k15:--num-speculative-tokens 15 --no-adaptive-speculation --modes plain dflash" \
           "k7:--num-speculative-tokens 7 --no-adaptive-speculation --modes dflash" \
           "adaptive:--num-speculative-tokens 15 --adaptive-speculation --modes dflash"; do
    name=${run%%:*}
    # shellcheck disable=SC2086  # the flags split on purpose
    timeout "${LIMIT:-170}" python3 -m dflash_cli.bench.step --steps 32 --batch-sizes 1 8 32 64 \
        --contexts 2048 8192 --no-hf --simulate-acceptance "$MEAN" --acceptance-curve geometric \
        ${run#*:} --out "$OUT" --name "adaptive_h200_$name" "$@" > "$OUT/adaptive_$name.log" 2>&1
    echo "$name: bench exit $?"
    tail -n 12 "$OUT/adaptive_$name.log"
done
# The three side by side: per case each run's ms, tok/s and acceptance, adaptive over the better fixed K.
python3 -m dflash_cli.bench.step_compare "$OUT"/adaptive_h200_k15.json "$OUT"/adaptive_h200_k7.json \
    "$OUT"/adaptive_h200_adaptive.json --out "$OUT" --name adaptive_h200 > /dev/null \
    && echo "side by side: $OUT/adaptive_h200.md"

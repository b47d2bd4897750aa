#!/usr/bin/env bash
# The serving features' H200 measurements in one device call: schemathesis and the poisons
# (bench/fuzz_h200.sh), what logprobs cost on the Qwen3-8B geometry, structured outputs with and
# without a schema, and the proposers' choice on the demo pair. Each step has its own time limit so
# the call ends inside the device's 10 minutes; every result lands in one folder, packed into
# $OUT/serving_features.tgz after each step (a device call returns at most 8 files, and a step cut
# short still leaves the ones before it). Carry [".whl"] (bench/device_wheels.sh makes it).
#
#   OUT=DIR bash bench/serving_features_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/serving_features}
RESULTS=$(mktemp -d)
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

pack() { tar czf "$OUT/serving_features.tgz" -C "$RESULTS" .; }
step() {  # step NAME LIMIT_S COMMAND...: its output in NAME.log, its exit status and time printed
    local name=$1 limit=$2 start
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    echo "$name: exit $? after $(( $(date +%s) - start )) s"
    pack
}

step fuzz "${FUZZ_LIMIT_S:-220}" env OUT="$RESULTS/fuzz" bash bench/fuzz_h200.sh --max-time-s "${FUZZ_TIME_S:-40}"
grep -h '"verdicts"' -A 12 "$RESULTS/fuzz/fuzz_gpu.json" 2>/dev/null | head -n 14
step logprobs "${LOGPROBS_LIMIT_S:-150}" python3 -m bench.bench_logprobs_cost --pair qwen3-8b --device cuda \
    --rounds 2 --name logprobs_cost_h200
cp bench/results/logprobs_cost_h200.* "$RESULTS/" 2>/dev/null && pack
grep -h '^|' "$RESULTS/logprobs_cost_h200.md" 2>/dev/null
step structured "${STRUCTURED_LIMIT_S:-90}" python3 -m bench.bench_structured_outputs --device cuda \
    --out "$RESULTS/structured_outputs_h200.md"
grep -h -A 7 '^## The engine' "$RESULTS/structured_outputs_h200.md" 2>/dev/null
step proposers "${PROPOSERS_LIMIT_S:-110}" python3 -m bench.bench_proposers --device cuda --prompts-per-class 4 \
    --rounds 2 --max-tokens 128 --out "$RESULTS/proposers_h200.md"
grep -h '^|' "$RESULTS/proposers_h200.md" 2>/dev/null | head -n 40

#!/usr/bin/env bash
# Run one device script with its outputs packed into a single file: a device call brings back at most
# 8 files from $OUT, and the step and proposer benches write several per run (md, json, png, log), so
# a call that runs a few of them loses the rest. The script writes to $OUT/r; what it wrote comes back
# as $OUT/results.tgz (re-packed after it exits, whatever its exit status, which is passed on).
#
#   OUT=$OUT bash bench/device_pack.sh bench/adaptive_h200.sh --batch-sizes 1 32 --contexts 2048
#   tar xzf <files_at>/results.tgz   # on this machine: r/ holds every file
set -uo pipefail
OUT=${OUT:?set OUT to the output folder of the device call}
script=${1:?name the script to run}
shift
mkdir -p "$OUT/r"
OUT="$OUT/r" bash "$script" "$@"
status=$?
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
exit "$status"

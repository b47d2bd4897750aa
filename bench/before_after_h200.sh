#!/usr/bin/env bash
# Issue 31's before and after, side by side on one H200 in one device call. The engine of BEFORE (by
# default fce1bc0: the compile watch had landed, no fix yet) and this tree's each serve issue 31's
# workload (`bench.fresh_server`, C 8, passes new / repeat / repeat / new) from an empty Triton cache,
# in alternation (before plain, after plain, before DFlash, after DFlash), then this tree's plain
# engine once more over the cache its run filled (plain's warm reference). Both engines are driven by
# this tree's client (`dflash_cli/bench/serve_*.py` and `bench/fresh_server.py` are copied over the
# old tree), so only the server differs; the before engine has no compile metric, so its compiles are
# counted by the harness's own watch (fresh_server's *_startup.json, each with its time since ready).
# MODES="plain" (or "dflash") runs one mode; KEPT=0 leaves out the kept-cache run. Both trees read one
# random pair (their writers are the same code, so the pair written first is reused). PART=step times
# the step bench of both trees instead (B 1 and 32, ctx 2048, K 15, no HF).
#
#   here, once:  bash bench/before_after_h200.sh --make-before [COMMIT]   (writes .before/tree.tar.gz)
#   device call: OUT=$OUT [PART=serve|step] bash bench/before_after_h200.sh     carry [".whl", ".before"]
#
# Everything lands in $OUT/before_after_<part>.tar.gz (a device call returns 8 files at most).
# SERVE_FLAGS / STEP_FLAGS are appended to the two benches' flags (a CPU smoke run: SERVE_FLAGS="--geometry
# tiny --device cpu ..." with WHEELS=0, the wheels being for the device's Python).
set -uo pipefail
if [ "${1:-}" = --make-before ]; then
    mkdir -p .before && { grep -qx "/.before/" .git/info/exclude || echo "/.before/" >> .git/info/exclude; }
    git archive --format=tar.gz -o .before/tree.tar.gz "${2:-fce1bc0}" -- . ':(exclude)target_service/demo_models' \
        ':(exclude)bench/results' ':(exclude)docs' ':(exclude)tests' ':(exclude)k8s'
    echo "${2:-fce1bc0}" > .before/commit
    exit
fi
OUT=${OUT:-bench/results}
PART=${PART:-serve}
work=$(mktemp -d)
mkdir -p /tmp/site "$OUT" "$work/before" "$work/results"
[ "${WHEELS:-1}" = 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
tar -xzf .before/tree.tar.gz -C "$work/before"
cp bench/fresh_server.py "$work/before/bench/"
cp dflash_cli/bench/serve_*.py dflash_cli/bench/plotting.py "$work/before/dflash_cli/bench/"
export PYTHONUNBUFFERED=1
after=$PWD
declare -A tree=([before]="$work/before" [after]="$after")

serve() {  # serve <before|after> <plain|dflash> <triton cache dir> <name>
    (cd "${tree[$1]}" && PYTHONPATH=/tmp/site:${tree[$1]} TRITON_CACHE_DIR=$3 timeout "${LIMIT:-200}" \
        python3 -m bench.fresh_server --mode "$2" --out "$work/results" --name "$4" --concurrency 8 \
        --checkpoints "${PAIR:-/tmp/dflash-e2e-pair}" ${SERVE_FLAGS:-} > "$work/results/$4.log" 2>&1)
    echo "$4: exit $?"; grep -E '^\{' "$work/results/$4.log" | head -n 1 | cut -c1-300
    grep -E '^\| concurrency 8 \| [0-9]' "$work/results/$4.md"
}

if [ "$PART" = serve ]; then
    for mode in ${MODES:-plain dflash}; do
        for side in before after; do
            cache="$work/cache_${side}_$mode"; mkdir -p "$cache"
            serve "$side" "$mode" "$cache" "${side}_$mode"
        done
    done
    [ "${KEPT:-1}" = 0 ] || serve after plain "$work/cache_after_plain" after_plain_kept_cache
else
    for side in before after; do
        (cd "${tree[$side]}" && PYTHONPATH=/tmp/site:${tree[$side]} timeout "${LIMIT:-240}" python3 -m dflash_cli.bench.step \
            --steps 16 --rounds 3 --batch-sizes 1 32 --contexts 2048 --no-hf --out "$work/results" \
            --name "step_$side" ${STEP_FLAGS:-} > "$work/results/step_$side.log" 2>&1)
        echo "step $side: exit $?"; grep -E '^\|' "$work/results/step_$side.md" | head -n 8
    done
fi
cat .before/commit > "$work/results/before_commit.txt" 2> /dev/null
tar -czf "$OUT/before_after_$PART${MODES:+_${MODES// /_}}.tar.gz" -C "$work/results" .
ls -la "$OUT"

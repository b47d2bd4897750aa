#!/usr/bin/env bash
# One device call for what users meet when serving on the H200 (Qwen3-8B geometry, random bf16 weights),
# in this order (each part's results are saved as it ends, so a call cut short keeps what ran):
#   split  `dflash serve` (Ray Serve) with --services inprocess and then ray, DFlash K 15, the same
#          load at C 1 and C 32 twice each (issue 33, item 5);
#   first  plain decoding from an empty Triton cache, three times: without the engine's warm-up forwards
#          (DFLASH_WARM_UP=0), with them, and without them under CUDA's eager module loading; passes
#          new / new at C 8, every step over 85 ms logged with what it held: where a first pass's
#          longest gap comes from and what the warm-up does to it (issue 31);
#   budget long prompts (3,000 tokens) among short ones at C 8 under --max-prefill-tokens-with-decodes
#          none / 1024 / 512: the gaps the decoding streams see and the long prompts' TTFT (issue 31).
# Carry [".whl", ".devray-serve"] (bench/device_wheels.sh without .whl/fuzz, bench/device_ray_serve.sh):
# together with the tree they fit the 64 MiB a call carries.
#
#   OUT=DIR [PARTS="split first budget"] [FIRST_VARIANTS="nowarm warm eager"] [KEEP_CACHE=1] bash bench/serving_h200.sh
# FIRST_VARIANTS may also name nofreeze (DFLASH_GC_FREEZE=0) and freeze; KEEP_CACHE=1 lets the first
# part's runs share one Triton cache (only the first compiles). The split's SPLIT_SERVICES ("inprocess
# ray"), SPLIT_CONCURRENCY ("1 32") and SPLIT_ROUNDS ("1 2") cut it down for a short device call.
# Everything lands in DIR/serving_h200.tar.gz (a call returns 8 files) and a summary is printed last.
# A dry run on a CPU (the tiny geometry, the checkout's venv): PYTHON=.venv/bin/python TINY=1 bash ...
set -uo pipefail
OUT=${OUT:-/tmp/serving_h200}
PARTS=${PARTS:-split first budget}
R=/tmp/serving_results && rm -rf "$R" && mkdir -p "$R" /tmp/site "$OUT"
if [ "${TINY:-0}" != 1 ]; then
    [ -f .devray-serve/ray-serve.tar.xz ] && tar -xJf .devray-serve/ray-serve.tar.xz -C /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export DFLASH_SLOW_STEP_MS=85 DFLASH_SLOW_STEP_LOG_EVERY_S=0
PY=${PYTHON:-python3}
PAIR=/tmp/dflash-e2e-pair GEOMETRY=qwen3-8b DTYPE=bfloat16 DEVICE=cuda MEMORY=24GiB LEN=4096 K=15
if [ "${TINY:-0}" = 1 ]; then PAIR=/tmp/dflash-tiny-pair GEOMETRY=tiny DTYPE=float32 DEVICE=cpu MEMORY=64MiB LEN=1024 K=7; fi
FRESH=(--checkpoints $PAIR --geometry $GEOMETRY --device $DEVICE --kv-cache-memory $MEMORY --max-model-len $LEN)
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' | tee "$R/env.txt"
git log -1 --format='commit %H %cd' >> "$R/env.txt" 2> /dev/null
summary() { grep -hE "$2" "$1" 2> /dev/null | tail -n "${3:-12}"; }

if [[ " $PARTS " == *" split "* ]]; then
    $PY -c "
from pathlib import Path
from bench.bench_serve_modes import write_word_tokenizer
from dflash_cli.bench.random_pair import write_random_pair
from foundation.checkpoint_config import load_target_config
target, drafter = write_random_pair(Path('$PAIR'), '$GEOMETRY', dtype='$DTYPE')
write_word_tokenizer(target, load_target_config(target).vocab_size)
print(target, drafter)" > "$R/pair.txt" 2>&1 || cat "$R/pair.txt"
    read -r TARGET DRAFTER < <(tail -n 1 "$R/pair.txt")
    port=8300
    for services in ${SPLIT_SERVICES:-inprocess ray}; do
        port=$((port + 1))
        $PY -m dflash_cli.main serve --target "$TARGET" --drafter "$DRAFTER" --services "$services" \
            --port $port --admin-port -1 -k $K --max-num-seqs 32 --max-model-len $LEN --kv-cache-memory $MEMORY \
            --device $DEVICE --dtype $DTYPE \
            --compile-cache-dir /tmp/split_cache > "$R/split_server_$services.log" 2>&1 &
        server=$!
        for _ in $(seq 150); do
            grep -q "ready at" "$R/split_server_$services.log" || ! kill -0 $server 2> /dev/null && break; sleep 1
        done
        summary "$R/split_server_$services.log" 'ready at|Error|error' 3
        for round in ${SPLIT_ROUNDS:-1 2}; do
            for c in ${SPLIT_CONCURRENCY:-1 32}; do
                n=$((c == 1 ? 16 : 64))
                timeout 90 $PY -m dflash_cli.main bench serve --url "http://127.0.0.1:$port/v1" --concurrency $c \
                    --num-prompts $n --prompts random --tokenizer-dir "$TARGET" --input-len 128 --output-len 128 \
                    --no-progress --out "$R" --name "split_${services}_c${c}_r$round" > "$R/split_bench.log" 2>&1
                echo "$services C $c round $round: exit $?"; summary "$R/split_${services}_c${c}_r$round.md" '^\| concurrency' 1
                tar -czf "$OUT/serving_h200.tar.gz" -C "$R" .  # a call cut short keeps each finished load
            done
        done
        kill -TERM $server; for _ in $(seq 40); do kill -0 $server 2> /dev/null || break; sleep 1; done
        kill -0 $server 2> /dev/null && kill -KILL $server
        wait $server 2> /dev/null
    done
fi
tar -czf "$OUT/serving_h200.tar.gz" -C "$R" .  # after each part: a call cut short keeps what ran

if [[ " $PARTS " == *" first "* ]]; then
    i=0 && shared=$(mktemp -d)
    for variant in ${FIRST_VARIANTS:-nowarm warm eager}; do  # each sets what it names, the rest default
        i=$((i + 1)) && loading=LAZY warm=1 freeze=1
        case $variant in nowarm) warm=0 ;; eager) loading=EAGER warm=0 ;; nofreeze) freeze=0 ;; esac
        cache=$(mktemp -d) && [ "${KEEP_CACHE:-0}" = 1 ] && cache=$shared  # kept: only the first compiles
        name=first_${variant}_$i
        CUDA_MODULE_LOADING=$loading DFLASH_WARM_UP=$warm DFLASH_GC_FREEZE=$freeze TRITON_CACHE_DIR=$cache \
            timeout 150 $PY -m bench.fresh_server --mode plain --out "$R" --name "$name" --passes new new \
            "${FRESH[@]}" > "$R/$name.log" 2>&1
        echo "first passes, $variant (CUDA_MODULE_LOADING=$loading DFLASH_WARM_UP=$warm DFLASH_GC_FREEZE=$freeze): exit $?"
        summary "$R/$name.log" '"ready_s"' 1
        summary "$R/$name.md" '^\| concurrency 8 \| [0-9]' 4
        summary "$R/$name.log" 'kept the running streams waiting' 30
        [ $variant = warm ] && KEPT=$cache
    done
fi
tar -czf "$OUT/serving_h200.tar.gz" -C "$R" .  # after each part: a call cut short keeps what ran

if [[ " $PARTS " == *" budget "* ]]; then
    (for _ in 1 2 3 4 5 6; do echo 32; done; echo 3000; echo 3000) > "$R/lens.txt"
    for cap in none 1024 512; do
        flag=() && [ "$cap" != none ] && flag=(--max-prefill-tokens-with-decodes "$cap")
        TRITON_CACHE_DIR=${KEPT:-$(mktemp -d)} timeout 100 $PY -m bench.fresh_server --mode plain --out "$R" \
            --name "budget_$cap" --passes new --input-lens-file "$R/lens.txt" "${FRESH[@]}" "${flag[@]}" \
            > "$R/budget_$cap.log" 2>&1
        echo "prefill beside decodes capped at $cap: exit $?"
        summary "$R/budget_$cap.md" '^\| concurrency 8 \| [0-9]' 2
        grep -c 'kept the running streams waiting' "$R/budget_$cap.log" | xargs echo "  steps over 85 ms:"
    done
fi
tar -czf "$OUT/serving_h200.tar.gz" -C "$R" .  # after each part: a call cut short keeps what ran

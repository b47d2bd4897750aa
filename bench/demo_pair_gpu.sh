#!/usr/bin/env bash
# The demo pair's GPU run, in two device calls (one call may last 10 minutes; training takes ~15).
#
#   bench/demo_pair_gpu.sh start    unpack the corpus, start bench/bench_train_demo.py in its own session
#   bench/demo_pair_gpu.sh start_drafter TARGET_DIR   the same for a drafter only, for a trained target
#   bench/demo_pair_gpu.sh finish   wait for it, measure the pair on this GPU, pack everything in $OUT
#
# The corpus is .corpus/corpus.tar.xz (ignored by git, carried to the machine): the CPython 3.11.7
# standard library of the training machine as corpus/stdlib (so held-out prompts split exactly as
# on that machine) plus the Python sources of 19 installed packages, one corpus root each (170 MB).
# Environment overrides (for a dry run on CPU): DEVICE, ROOTS, TARGET_SECONDS, DRAFTER_SECONDS,
# GENERATED, EXTRA_TARGET_ARGS, EXTRA_DRAFTER_ARGS (later flags win).
set -euo pipefail
WORK=/tmp/demo_gpu
CORPUS=/tmp/corpus
PAIR=$WORK/pair

unpack_corpus() {  # sets $roots: stdlib first, then the packages in sorted order
    python3 -c "import tarfile; tarfile.open('.corpus/corpus.tar.xz').extractall('/tmp', filter='data')"
    roots=${ROOTS:-"$CORPUS/stdlib $(find "$CORPUS" -mindepth 1 -maxdepth 1 -type d ! -name stdlib | sort | tr '\n' ' ')"}
}

start() {
    mkdir -p "$WORK"
    local roots
    unpack_corpus
    local target_args="--corpus $roots --layers 6 --hidden 384 --heads 4 --kv-heads 2 --head-dim 64
        --intermediate 768 --seq-len 512 --batch-size 64 --warmup-steps 200 ${EXTRA_TARGET_ARGS:-}"
    local drafter_args="--corpus $roots --layers 2 --seq-len 384 --prompt-len 64 --gen-tokens 320
        --gen-batch 2048 --steps 100000 --batch-size 64 --anchors 48 --eval-prompts 64 --eval-max-tokens 256
        --timing-prompts 8 --eval-dtype float32 ${EXTRA_DRAFTER_ARGS:-}"
    setsid nohup bash -c "python3 -m bench.bench_train_demo --out $WORK/out --work $PAIR --device ${DEVICE:-cuda} \
        --target-seconds ${TARGET_SECONDS:-240} --drafter-seconds ${DRAFTER_SECONDS:-330} \
        --generated ${GENERATED:-32768} --target-args '$target_args' --drafter-args '$drafter_args'; \
        echo \$? > $WORK/rc" > "$WORK/train.log" 2>&1 < /dev/null &
    echo "training started; log $WORK/train.log"
}

start_drafter() {
    mkdir -p "$WORK/out" "$PAIR"
    cp -r "$1" "$PAIR/target"
    local roots
    unpack_corpus
    setsid nohup bash -c "python3 -m dflash_cli.main train drafter --target $PAIR/target --out $PAIR/drafter \
        --device ${DEVICE:-cuda} --seed ${SEED:-1} --time-budget ${DRAFTER_SECONDS:-480} --generated ${GENERATED:-32768} \
        --generated-fraction 0.75 --corpus $roots --layers ${DRAFT_LAYERS:-3} --seq-len 384 --prompt-len 64 \
        --gen-tokens 320 --gen-batch 2048 --steps 100000 --batch-size 64 --anchors 48 --eval-prompts 64 \
        --eval-max-tokens 256 --timing-prompts 8 --eval-dtype float32 ${EXTRA_DRAFTER_ARGS:-}; \
        echo \$? > $WORK/rc; echo '{}' > $WORK/out/commands.json" > "$WORK/train.log" 2>&1 < /dev/null &
    echo "drafter training started; log $WORK/train.log"
}

finish() {
    while [ ! -f "$WORK/rc" ]; do sleep 5; done
    tail -n 40 "$WORK/train.log"
    local rc
    rc=$(cat "$WORK/rc")
    cp "$WORK/train.log" "$OUT/train.log"
    [ "$rc" = 0 ] || { echo "training failed: rc $rc"; exit 1; }
    for dtype in float32 bfloat16; do
        python3 -m bench.bench_demo_speedup --target "$PAIR/target" --drafter "$PAIR/drafter" --corpus "$CORPUS/stdlib" \
            --device ${DEVICE:-cuda} --dtype $dtype --prompts 32 --timing-prompts 8 --max-tokens 128 \
            --name "speedup_h200_$dtype" || echo "speedup $dtype failed"
    done
    tar -cf "$WORK/results.tar" -C bench/results $(cd bench/results && ls speedup_h200_* 2>/dev/null) \
        -C "$WORK/out" commands.json
    cp "$WORK/results.tar" "$OUT/"
    tar -cf "$WORK/pair.tar" --exclude checkpoints -C "$PAIR" target drafter
    split -b 15M "$WORK/pair.tar" "$OUT/pair.tar.part-"
    ls -la "$OUT"
}

"$@"

#!/usr/bin/env bash
# The step on one H200 (Qwen3-8B geometry, random weights): the GPU tests of the step's path, then
# the step bench (`dflash bench step`, run as python -m dflash_cli.bench.step). One device call; carry
# [".whl"] (pydantic, gRPC: the image lacks them).
#
#   bash bench/step_h200.sh [flags for dflash_cli.bench.step; later flags win]
#
# The bench saves after every case to $OUT (default bench/results), so a run stopped at LIMIT
# seconds (default 420) keeps what it measured; the tests' and the bench's logs go there too.
# TESTS=0 skips the GPU tests.
# BASELINE=<commit> also times that commit's engine (B 1 and 32, ctx 2048, no HF) from a worktree,
# right after, on the same machine: a side-by-side reference for a change to the step (a commit from
# before the step bench moved into dflash_cli runs its bench/bench_e2e_step.py). The device's
# git may only know the session's first commit: BASELINE_PATCH=<file> (the diff from the baseline to
# this tree, untracked) times this tree with that diff undone instead.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p /tmp/site "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c 'import pydantic, grpc, torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [ "${TESTS:-1}" != 0 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/unit/foundation/test_host_transfer.py tests/unit/target_service/test_verify.py \
        tests/engine/test_engine_gpu.py tests/unit/target_service/test_cuda_graph_padding.py \
        tests/engine/test_context_rows.py tests/engine/test_kv_cache_dtype.py \
        tests/unit/kernels/test_fused_layers.py tests/unit/kernels/test_qkv_epilogue.py \
        tests/unit/target_service/test_target_model.py tests/unit/drafter_service/test_drafter_model.py \
        > "$OUT/gpu_tests_step.txt" 2>&1
    tail -n 3 "$OUT/gpu_tests_step.txt"
fi
timeout "${LIMIT:-420}" python3 -m dflash_cli.bench.step --steps 8 --batch-sizes 1 32 --contexts 2048 8192 \
    --out "$OUT" --name e2e_step_h200_device "$@" > "$OUT/e2e_step.log" 2>&1
echo "bench exit $?"
tail -n 30 "$OUT/e2e_step.log"
if [ -n "${BASELINE_PATCH:-}" ]; then  # the device's git may lack this session's commits: a patch instead
    cp -r "$PWD" /tmp/baseline && (cd /tmp/baseline && git apply -R "$PWD/$BASELINE_PATCH") || echo "no baseline"
    BASELINE=patch
elif [ -n "${BASELINE:-}" ]; then
    git worktree add -f /tmp/baseline "$BASELINE" > /dev/null 2>&1 || echo "no worktree of $BASELINE"
fi
if [ -n "${BASELINE:-}" ]; then
    step=dflash_cli.bench.step
    [ -f /tmp/baseline/bench/bench_e2e_step.py ] && step=bench.bench_e2e_step
    (cd /tmp/baseline && PYTHONPATH=/tmp/site:/tmp/baseline timeout "${BASELINE_LIMIT:-150}" python3 -m $step \
        --steps 8 --batch-sizes 1 32 --contexts 2048 --no-hf --out "$OUT" --name "${BASELINE_NAME:-e2e_step_h200_baseline}" \
        > "$OUT/e2e_step_baseline.log" 2>&1)
    echo "baseline exit $?"
    tail -n 12 "$OUT/e2e_step_baseline.log"
fi
[ "${TESTS:-1}" = 0 ] || { echo "GPU tests:"; tail -n 3 "$OUT/gpu_tests_step.txt"; }

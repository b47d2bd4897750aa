#!/usr/bin/env bash
# `dflash serve` on one H200, Qwen3-8B geometry (random weights, 5-layer DFlash-b16 drafter): the
# requests admitted at equal memory, paged vs dense, then plain, dense-context and paged-context
# serving at concurrency 1-64 (bench/bench_serve_modes.py). One device call of at most ~8 minutes:
#
#   bash bench/serve_modes_h200.sh [more flags for bench.bench_serve_modes; later flags win]
#
# The machine has torch, triton and transformers but no Ray Serve and maybe not the server's
# packages: they come as wheels in .whl/ (git-ignored, so carried), installed to /tmp/site when this
# Python is the 3.12 they were downloaded for (elsewhere the environment's own packages are used).
# The random pair is written once to /tmp/dflash-e2e-pair (where dflash bench step writes the same pair:
# reused when present) and loaded by every engine. Every serving mode gets the same 32 GiB KV budget
# (dense takes its 64 x 8192-token draft reservation out of it), so a mode never depends on what the
# one before it left on the device.
# Nothing starts past --budget-s (390 s): what would is listed as skipped in the results, which are
# saved after every part to $OUT (default bench/results), with this run's log.
#
# A dry run on CPU with the demo pair and tiny settings (the path end to end, in ~15 s):
#   PYTHON=.venv/bin/python OUT=/tmp/serve_modes bash bench/serve_modes_h200.sh --device cpu \
#       --target target_service/demo_models/target --drafter target_service/demo_models/drafter \
#       --concurrency 1 2 --input-len 32 --output-len 16 --max-model-len 512 --kv-cache-memory 16MiB \
#       --admission-memory 32MiB --admission-max-model-len 4096 1024 --admission-max-num-seqs 64 \
#       --admission-requests 40 --admission-prompt-len 128 --admission-max-tokens 16 --name serve_modes_cpu
set -euo pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if [ "$($PYTHON -c 'import sys; print(sys.version_info[:2] == (3, 12))')" = True ] && ls .whl/*.whl > /dev/null 2>&1; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
$PYTHON -c 'import fastapi, uvicorn, httpx, prometheus_client, jinja2, grpc, torch; print("torch", torch.__version__)'
$PYTHON -m bench.bench_serve_modes --geometry qwen3-8b --checkpoints /tmp/dflash-e2e-pair \
    --parts admission serve --modes paged dense plain \
    --concurrency 1 2 4 8 16 32 64 --input-len 1024 --output-len 256 --prompts-per-level 1 --min-prompts 4 \
    --max-model-len 8192 --kv-cache-memory 32GiB \
    --admission-memory 8GiB --admission-max-model-len 32768 8192 --admission-max-num-seqs 256 \
    --admission-requests 128 --admission-prompt-len 2048 --admission-max-tokens 256 \
    --budget-s 390 --out "$OUT" --name serve_modes_h200 "$@" 2>&1 | tee "$OUT/serve_modes.log"

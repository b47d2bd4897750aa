#!/usr/bin/env bash
# dflash serve on CPU with the demo pair, one replica, --services inprocess then ray, each under the same
# dflash bench serve load: what driving the three service actors costs a server.
#   bash bench/serve_services_cpu.sh   (from the repository root, after make setup)
# Settings (environment): MODES ("inprocess ray"), CONCURRENCY ("1 4 8"), NUM_PROMPTS (32),
# MAX_NUM_SEQS (8), NAME (serve_services_cpu: results are bench/results/NAME_MODE.*), PYTHON (.venv's),
# SERVER_ARGS (extra `dflash serve` flags, e.g. another pair: --target T --drafter D -k 7) and
# BENCH_ARGS (extra `dflash bench serve` flags, e.g. --prompts random --tokenizer-dir T --input-len 128).
set -u
# shellcheck disable=SC2086  # the flag lists split into words on purpose
cd "$(dirname "$0")/.."
MODES=${MODES:-inprocess ray}
CONCURRENCY=${CONCURRENCY:-1 4 8}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-8}
NAME=${NAME:-serve_services_cpu}
PYTHON=${PYTHON:-.venv/bin/python}
for mode in $MODES; do
  port=$((8200 + ${#mode}))
  RAY_USAGE_STATS_ENABLED=0 $PYTHON -m dflash_cli.main serve --port $port --admin-port -1 --replicas 1 --device cpu --dtype float32 --kv-cache-memory 64MiB --max-model-len 512 --max-num-seqs "$MAX_NUM_SEQS" --services $mode ${SERVER_ARGS:-} > /tmp/serve_$mode.log 2>&1 &
  pid=$!
  for i in $(seq 120); do grep -q "ready at" /tmp/serve_$mode.log && break; sleep 1; done
  $PYTHON -m dflash_cli.main bench serve --url http://127.0.0.1:$port/v1 --concurrency $CONCURRENCY --num-prompts "$NUM_PROMPTS" --output-len 128 --no-progress ${BENCH_ARGS:-} --out bench/results --name "${NAME}_$mode" > /tmp/bench_$mode.log 2>&1
  kill -TERM $pid; wait $pid; echo "$mode server exit $?"
done

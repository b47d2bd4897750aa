#!/usr/bin/env bash
# dflash serve on CPU with the demo pair, one replica, --services inprocess then ray, each under the same
# dflash bench serve load (concurrency 1, 4, 8): what driving the three service actors costs a server.
#   bash bench/serve_services_cpu.sh   (from the repository root, after make setup)
set -u
cd "$(dirname "$0")/.."
for mode in inprocess ray; do
  port=$((8200 + ${#mode}))
  RAY_USAGE_STATS_ENABLED=0 .venv/bin/dflash serve --port $port --admin-port -1 --replicas 1 --device cpu --dtype float32 --kv-cache-memory 64MiB --max-model-len 512 --max-num-seqs 8 --services $mode > /tmp/serve_$mode.log 2>&1 &
  pid=$!
  for i in $(seq 120); do grep -q "ready at" /tmp/serve_$mode.log && break; sleep 1; done
  .venv/bin/dflash bench serve --url http://127.0.0.1:$port/v1 --concurrency 1 4 8 --num-prompts 32 --output-len 128 --no-progress --out bench/results --name serve_services_cpu_$mode > /tmp/bench_$mode.log 2>&1
  kill -TERM $pid; wait $pid; echo "$mode server exit $?"
done

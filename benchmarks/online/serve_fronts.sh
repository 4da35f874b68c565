#!/usr/bin/env bash
# serve-vs-engine (WORKLOADS.md) with 1 or more front processes over one engine core, as in docs/benchmarks/serve.md:
#   REDIS_URL=redis://127.0.0.1:6379/0 RUNS="256:1 256:2 64:1 64:2" bash benchmarks/online/serve_fronts.sh OUT_DIR
# RUNS: concurrency:fronts pairs. More than one front needs Redis (sessions are shared); one front uses it too, so
# both run the same server. Each run prints its table; the JSON goes to OUT_DIR.
set -eu
out=${1:?usage: serve_fronts.sh OUT_DIR}
mkdir -p "$out"
server_args="--load-format dummy --model-config llama-3.2-1b --max-queue 1024 --redis-url ${REDIS_URL:?set REDIS_URL}"
for run in ${RUNS:-256:1 256:2 64:1 64:2}; do
  concurrency=${run%%:*}
  fronts=${run##*:}
  python3 -m benchmarks.online.serve --compare-offline --concurrency "$concurrency" --input-len 512 --output-len 256 \
    --endpoint completions --server-args "$server_args --api-server-count $fronts" \
    --json "$out/serve-c$concurrency-n$fronts-$(date +%H%M%S).json" > "$out/serve-c$concurrency-n$fronts.log" 2>&1
  echo "### C=$concurrency fronts=$fronts"
  grep -A8 "## serve-vs-engine" "$out/serve-c$concurrency-n$fronts.log" | tail -6
done

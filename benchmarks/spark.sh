#!/usr/bin/env bash
# Spark throughput: the demo release on local[2] and on a 2-worker standalone cluster, and the single
# count job on dprelease vs PipelineDP's SparkRDDBackend (local[2]). Whole processes under /usr/bin/time -v:
# wall seconds and the largest resident set of the driver process tree (python driver + its JVM).
# Usage: benchmarks/spark.sh [ROWS ...]   (default: 10000000 50000000); PEER_MAX_ROWS caps the peer (1000000).
set -euo pipefail
cd "$(dirname "$0")"
sizes=("$@")
[ "${#sizes[@]}" -gt 0 ] || sizes=(10000000 50000000)
# shellcheck source=measure.sh
source ./measure.sh
run_dir=$(mktemp -d)
trap '../deploy/spark/stop-cluster.sh "$run_dir" >/dev/null 2>&1 || true; rm -rf "$run_dir"' EXIT
url=$(PYTHON=python ../deploy/spark/start-cluster.sh "$run_dir" 2 | tail -n 1)
for rows in "${sizes[@]}"; do
  data=$(demo_data "$rows")
  rm -rf out/spark-releases
  measure "demo release (spark local[2])" "$rows" dprelease run ../examples/demo/spec.yaml --engine spark \
    --master "local[2]" --input "$data/persons.parquet" --out out/spark-releases/local --key-file "out/keys/s-$rows.key" --no-ledger
  measure "demo release (2-worker cluster)" "$rows" env PYTHON=python ../deploy/spark/submit.sh "$url" \
    ../examples/demo/spec.yaml --input "$PWD/$data/persons.parquet" --out out/spark-releases/cluster --key-file "out/keys/s-$rows.key" --no-ledger
  measure "count job (dprelease spark local[2])" "$rows" dprelease run count_spec.yaml --engine spark \
    --master "local[2]" --input "$data/persons.parquet" --out out/spark-releases/count --key-file "out/keys/c-$rows.key" --no-ledger
  if python -c "import pipeline_dp" 2>/dev/null && [ "$rows" -le "${PEER_MAX_ROWS:-1000000}" ]; then
    measure "count job (PipelineDP SparkRDD)" "$rows" python pipelinedp_count.py "$data/persons.parquet" "$data/geography.txt" --backend spark
  fi
done

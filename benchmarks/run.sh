#!/usr/bin/env bash
# Throughput and peak memory of the demo release, the single count job and the sum + median job
# (dprelease vs PipelineDP).
# Usage: benchmarks/run.sh [ROWS ...]   (default: 1000000 10000000). Needs `pip install ".[bench]" pipeline-dp`.
# Each figure is one whole process measured by /usr/bin/time -v: wall seconds and maximum resident set size.
set -euo pipefail
cd "$(dirname "$0")"
sizes=("$@")
[ "${#sizes[@]}" -gt 0 ] || sizes=(1000000 10000000)
# shellcheck source=measure.sh
source ./measure.sh
for rows in "${sizes[@]}"; do
  data=$(demo_data "$rows")
  rm -rf out/releases out/keys
  measure "demo release" "$rows" dprelease run ../examples/demo/spec.yaml --input "$data/persons.parquet" \
    --out out/releases --key-file "out/keys/demo-$rows.key" --no-ledger
  measure "count job (dprelease)" "$rows" dprelease run count_spec.yaml --input "$data/persons.parquet" \
    --out out/releases --key-file "out/keys/count-$rows.key" --no-ledger
  measure "sum + median job (dprelease)" "$rows" dprelease run measures_spec.yaml --input "$data/persons.parquet" \
    --out out/releases --key-file "out/keys/measures-$rows.key" --no-ledger
  if python -c "import pipeline_dp" 2>/dev/null && [ "$rows" -le "${PEER_MAX_ROWS:-1000000}" ]; then
    measure "count job (PipelineDP local)" "$rows" python pipelinedp_count.py "$data/persons.parquet" "$data/geography.txt"
    measure "sum + median job (PipelineDP local)" "$rows" python pipelinedp_measures.py "$data/persons.parquet" \
      "$data/geography.txt"
  fi
done

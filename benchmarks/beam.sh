#!/usr/bin/env bash
# Beam throughput: the demo release and the single count job on the DirectRunner (multi_processing,
# 2 worker processes), vs PipelineDP's BeamBackend on the same count job and runner, in the same run.
# Whole processes under /usr/bin/time -v: wall seconds and the largest resident set among the processes
# the timer waits on. Usage: benchmarks/beam.sh [ROWS ...]   (default: 1000000 10000000);
# PEER_MAX_ROWS caps the peer (default 1000000: it runs at ~13k rows/s). Needs `pip install ".[beam,bench]" pipeline-dp`.
set -euo pipefail
cd "$(dirname "$0")"
sizes=("$@")
[ "${#sizes[@]}" -gt 0 ] || sizes=(1000000 10000000)
# shellcheck source=measure.sh
source ./measure.sh
for rows in "${sizes[@]}"; do
  data=$(demo_data "$rows")
  rm -rf out/beam-releases
  measure "demo release (beam, 2 workers)" "$rows" dprelease run ../examples/demo/spec.yaml --engine beam \
    --workers 2 --no-ledger --input "$data/persons.parquet" --out out/beam-releases --key-file "out/keys/b-$rows.key"
  measure "count job (dprelease beam)" "$rows" dprelease run count_spec.yaml --engine beam --workers 2 \
    --no-ledger --input "$data/persons.parquet" --out out/beam-releases --key-file "out/keys/bc-$rows.key"
  if python -c "import pipeline_dp, apache_beam" 2>/dev/null && [ "$rows" -le "${PEER_MAX_ROWS:-1000000}" ]; then
    measure "count job (PipelineDP Beam)" "$rows" python pipelinedp_count.py "$data/persons.parquet" \
      "$data/geography.txt" --backend beam
  fi
done

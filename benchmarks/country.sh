#!/usr/bin/env bash
# Census scale on the embedded engine: a country's geography (51 states, 3,577 counties, 44,627 tracts,
# Zipf-like sizes), the demo-shaped release (country_spec.yaml), the same with the marginals within tract
# (country_tract_spec.yaml: 70.7M joint cells on the joint path) and the count-only job on the same rows
# (country_count_spec.yaml), each one whole process under /usr/bin/time -v; then the stage breakdown of
# the release in one process (stages.py).
# Usage: benchmarks/country.sh [ROWS ...]   (default: 10000000). WORKERS: --workers (default: every core);
# TRACTS: tracts in all (default 44627; 66000 puts 104.5M joint cells on the within-tract joint path).
set -euo pipefail
cd "$(dirname "$0")"
sizes=("$@")
[ "${#sizes[@]}" -gt 0 ] || sizes=(10000000)
# shellcheck source=measure.sh
source ./measure.sh
workers=(); [ -z "${WORKERS:-}" ] || workers=(--workers "$WORKERS")
tracts="${TRACTS:-44627}"
for rows in "${sizes[@]}"; do
  data="out/country-$rows"; [ "$tracts" = 44627 ] || data="out/country-$rows-$tracts"
  [ -f "$data/persons.parquet" ] || dprelease demo-data --rows "$rows" --states 51 --counties 3577 --tracts "$tracts" \
    --out "$data" >/dev/null
  mkdir -p out/country && cp "$data/geography.txt" out/country/geography.txt  # one geography for every size
  rm -rf out/releases out/keys
  measure "count job ($tracts tracts)" "$rows" dprelease run country_count_spec.yaml --input "$data/persons.parquet" \
    --key-file "out/keys/count-$rows.key" --no-ledger "${workers[@]}"
  measure "country release (within county)" "$rows" dprelease run country_spec.yaml --input "$data/persons.parquet" \
    --key-file "out/keys/country-$rows.key" --no-ledger "${workers[@]}"
  measure "country release (within tract)" "$rows" dprelease run country_tract_spec.yaml \
    --input "$data/persons.parquet" --key-file "out/keys/tract-$rows.key" --no-ledger "${workers[@]}"
  python stages.py country_spec.yaml "$data/persons.parquet" "${WORKERS:-0}"
  python stages.py country_tract_spec.yaml "$data/persons.parquet" "${WORKERS:-0}"
done

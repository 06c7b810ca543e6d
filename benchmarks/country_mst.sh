#!/usr/bin/env bash
# `select: mst` at a country's scale on the embedded engine: country_mst_spec.yaml (a hierarchy and MST within
# county over 5 attributes: selection over 10 candidate pairs per county, the tree path per county) against
# the same spec with `select: all` (every pair measured; the joint path), one whole process each under
# /usr/bin/time -v, on the rows country.sh generates.
# The same spec with `select: aim` (AIM-style rounds within county: 4 rounds, each a pass over the rows) too.
# Usage: benchmarks/country_mst.sh [ROWS]   (default: 10000000). WORKERS: --workers (default: every core).
# SPARK=1: the MST and AIM releases also on Spark local[2] (candidates scored in the executors, every AIM pass
# counted from the bounded records kept on the executors), beside the embedded ones.
set -euo pipefail
cd "$(dirname "$0")"
rows="${1:-10000000}"
# shellcheck source=measure.sh
source ./measure.sh
workers=(); [ -z "${WORKERS:-}" ] || workers=(--workers "$WORKERS")
data="out/country-$rows"
[ -f "$data/persons.parquet" ] || dprelease demo-data --rows "$rows" --states 51 --counties 3577 --tracts 44627 \
  --out "$data" >/dev/null
mkdir -p out/country && cp "$data/geography.txt" out/country/geography.txt
sed 's/select: mst/select: all/; s/^release_id: country-mst-2026/release_id: country-all-2026/' country_mst_spec.yaml \
  > out/country_all_spec.yaml
sed -i 's#domain_file: out/country/geography.txt#domain_file: country/geography.txt#; s#dir: out/releases#dir: releases#' \
  out/country_all_spec.yaml
sed 's/select: mst/select: aim/; s/^release_id: country-mst-2026/release_id: country-aim-2026/' country_mst_spec.yaml \
  > out/country_aim_spec.yaml
sed -i 's#domain_file: out/country/geography.txt#domain_file: country/geography.txt#; s#dir: out/releases#dir: releases#' \
  out/country_aim_spec.yaml
rm -rf out/releases out/keys
measure "MST within county" "$rows" dprelease run country_mst_spec.yaml --input "$data/persons.parquet" \
  --key-file "out/keys/mst-$rows.key" --no-ledger "${workers[@]}"
measure "AIM within county" "$rows" dprelease run out/country_aim_spec.yaml --input "$data/persons.parquet" \
  --key-file "out/keys/aim-$rows.key" --no-ledger "${workers[@]}"
measure "all 2-way within county" "$rows" dprelease run out/country_all_spec.yaml --input "$data/persons.parquet" \
  --key-file "out/keys/all-$rows.key" --no-ledger "${workers[@]}"
if [ -n "${SPARK:-}" ]; then
  measure "MST within county, spark local[2]" "$rows" dprelease run country_mst_spec.yaml --input "$data/persons.parquet" \
    --key-file "out/keys/mst-$rows.key" --no-ledger --engine spark --master "local[2]" \
    --out out/releases-spark
  measure "AIM within county, spark local[2]" "$rows" dprelease run out/country_aim_spec.yaml \
    --input "$data/persons.parquet" --key-file "out/keys/aim-$rows.key" --no-ledger --engine spark \
    --master "local[2]" --out out/releases-spark
fi

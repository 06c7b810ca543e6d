#!/usr/bin/env bash
# One release of a monthly series: fill the month into a spec template, run it against the ledger
# (refused with exit 3, nothing published, once the dataset's budget is spent), then verify it.
# Usage: monthly-release.sh TEMPLATE.yaml MONTH(YYYY-MM) LEDGER KEY_DIR [dprelease run options]
# The template uses {{MONTH}} wherever the month belongs (release_id, input path).
# Exit codes: those of `dprelease run` (0 ok, 2 spec, 3 budget refused, 1 other); 1 if verify fails.
set -euo pipefail
template="${1:?usage: monthly-release.sh TEMPLATE MONTH LEDGER KEY_DIR [run options]}"
month="${2:?month YYYY-MM}"
ledger="${3:?ledger file or URL}"
key_dir="${4:?key directory}"
shift 4
[[ "$month" =~ ^[0-9]{4}-[0-9]{2}$ ]] || { echo "month ($month) must be YYYY-MM" >&2; exit 2; }
spec="$(dirname "$template")/.$(basename "$template" .yaml)-$month.yaml"
sed "s/{{MONTH}}/$month/g" "$template" >"$spec"
mkdir -p "$key_dir" && chmod 700 "$key_dir"
exec "$(dirname "$0")/../run-and-verify.sh" "$spec" --ledger "$ledger" --key-file "$key_dir/$month.key" "$@"

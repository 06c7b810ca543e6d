#!/usr/bin/env bash
# One release of a monthly series: fill the month into a spec template, run it against the ledger
# (refused with exit 3, nothing published, once the dataset's budget is spent), then verify it.
# Usage: monthly-release.sh TEMPLATE.yaml MONTH(YYYY-MM) LEDGER KEY_DIR [dprelease run options]
# The template uses {{MONTH}} wherever the month belongs (release_id, period, input path); its relative paths
# start from the template's directory. The filled-in spec goes to a private work directory (removed on exit),
# never beside the template.
# A month already published is a no-op (exit 0) once it verifies against the ledger: a catch-up or repeated
# run leaves it as published. With --overwrite, the month is run again with its key: free, and refused
# (exit 2, nothing changed) when its spec or data changed since.
# Exit codes: those of `dprelease run` (0 ok, 2 spec, 3 budget refused, 1 other); 1 if verify fails.
set -euo pipefail
template="${1:?usage: monthly-release.sh TEMPLATE MONTH LEDGER KEY_DIR [run options]}"
month="${2:?month YYYY-MM}"
ledger="${3:?ledger file or URL}"
key_dir="${4:?key directory}"
shift 4
[[ "$month" =~ ^[0-9]{4}-[0-9]{2}$ ]] || { echo "month ($month) must be YYYY-MM" >&2; exit 2; }
template_dir="$(cd "$(dirname "$template")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/dprelease-monthly-XXXXXX")"  # mode 0700
trap 'rm -rf "$work"' EXIT
spec="$work/$(basename "$template" .yaml)-$month.yaml"
sed "s/{{MONTH}}/$month/g" "$template" >"$spec"
mkdir -p "$key_dir" && chmod 700 "$key_dir"
overwrite=no
for argument in "$@"; do [ "$argument" = "--overwrite" ] && overwrite=yes; done
release_dir="$(dprelease plan "$spec" --base-dir "$template_dir" --json \
               | python3 -c 'import json, sys; print(json.load(sys.stdin)["release_dir"])')"
if [ "$overwrite" = no ] && [ -f "$release_dir/manifest.json" ]; then
  dprelease verify "$release_dir" --ledger "$ledger"
  echo "Release for $month already published at $release_dir and verified against the ledger; nothing to do"
  exit 0
fi
"$(dirname "$0")/../run-and-verify.sh" "$spec" --base-dir "$template_dir" --ledger "$ledger" \
  --key-file "$key_dir/$month.key" "$@"

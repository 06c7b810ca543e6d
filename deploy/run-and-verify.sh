#!/usr/bin/env bash
# Run one release, then verify what it published. Usage: run-and-verify.sh SPEC [dprelease run options]
# Exit codes: those of `dprelease run` (0 ok, 2 spec, 3 budget refused, 1 other); 1 if verify fails.
set -euo pipefail
spec="${1:?usage: run-and-verify.sh SPEC [dprelease run options]}"
shift
set +e
output=$(dprelease run "$spec" "$@")
status=$?
set -e
printf '%s\n' "$output"
[ "$status" -eq 0 ] || exit "$status"
release_dir=$(printf '%s\n' "$output" | sed -n 's/^Published release .* to //p' | tail -n 1)
dprelease verify "$release_dir"

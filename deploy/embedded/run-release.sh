#!/usr/bin/env bash
# Run one release on the embedded engine and verify it. Usage: run-release.sh SPEC KEY_DIR [run options]
set -euo pipefail
if [ "$#" -lt 2 ]; then
  echo "usage: $0 SPEC KEY_DIR [dprelease run options]" >&2
  exit 2
fi
spec="$1"; key_dir="$2"; shift 2
mkdir -p "$key_dir"
chmod 700 "$key_dir"
key_file="$key_dir/$(basename "$spec" .yaml)-$(date -u +%Y%m%dT%H%M%SZ).key"
exec "$(dirname "$0")/../run-and-verify.sh" "$spec" --key-file "$key_file" "$@"

#!/usr/bin/env bash
# Stop the master and workers that start-cluster.sh started, by the pids it recorded.
# Usage: stop-cluster.sh RUN_DIR
set -uo pipefail
run_dir="${1:?usage: stop-cluster.sh RUN_DIR}"
status=0
for pid_file in "$run_dir"/worker-*.pid "$run_dir"/master.pid; do
  [ -f "$pid_file" ] || continue
  pid=$(cat "$pid_file")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { kill -9 "$pid" 2>/dev/null; status=1; }
  fi
  rm -f "$pid_file"
done
exit "$status"

#!/usr/bin/env bash
# Run a release on a Spark cluster through spark-submit, shipping the dprelease package to executors.
# Usage: submit.sh MASTER_URL SPEC [dprelease run options] [-- extra spark-submit options]
# The package (with its compiled sampler kernel) is zipped from this installation and shipped with
# --archives; executors import it from the extracted folder. They need the same Python version and
# platform, and numpy, pyarrow, cryptography, pydantic and PyYAML (or ship a packed venv instead, see
# deploy/spark/README.md). Relative paths (the spec, --out, --input, --ledger, --key-file, --internal-dir,
# --sign-key) are made absolute here, against the directory it is called from, so that neither the driver nor an
# executor resolves one against a work directory of its own; URIs (s3://...) pass unchanged.
set -euo pipefail
absolute() {  # a path as an absolute path; a URI as it is
  case "$1" in
    *://*|/*) printf '%s' "$1" ;;
    *) printf '%s/%s' "$PWD" "$1" ;;
  esac
}
master="${1:?usage: submit.sh MASTER_URL SPEC [run options] [-- spark-submit options]}"
spec="$(absolute "${2:?usage: submit.sh MASTER_URL SPEC [run options] [-- spark-submit options]}")"
shift 2
run_args=() submit_args=()
while [ "$#" -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; submit_args=("$@"); break; fi
  case "$1" in
    --out|--input|--ledger|--key-file|--internal-dir|--sign-key)
      [ "$#" -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
      run_args+=("$1" "$(absolute "$2")"); shift 2 ;;
    --out=*|--input=*|--ledger=*|--key-file=*|--internal-dir=*|--sign-key=*)
      run_args+=("${1%%=*}=$(absolute "${1#*=}")"); shift ;;
    *) run_args+=("$1"); shift ;;
  esac
done
python="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
"$python" - "$stage/dprelease" <<'PY'
import importlib, shutil, sys
from pathlib import Path
target = Path(sys.argv[1])
for name in ("pipelines", "transforms", "accounting", "examples"):
    module = importlib.import_module(f"dprelease.{name}")
    shutil.copytree(Path(module.__path__[0]), target / name,
                    ignore=shutil.ignore_patterns("__pycache__", "*.c", "data", "releases", "keys"))
PY
(cd "$stage" && "$python" -m zipfile -c dprelease-package.zip dprelease)
spark_home="$("$python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
# not exec: the trap above removes the package's temporary directory once spark-submit has finished
"$spark_home/bin/spark-submit" --master "$master" \
  --archives "$stage/dprelease-package.zip#dprelease_package" \
  --conf spark.executorEnv.PYTHONPATH=dprelease_package \
  --conf "spark.pyspark.python=$("$python" -c 'import sys; print(sys.executable)')" \
  "${submit_args[@]}" \
  "$here/launcher.py" run "$spec" --engine spark "${run_args[@]}"

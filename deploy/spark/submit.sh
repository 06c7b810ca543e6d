#!/usr/bin/env bash
# Run a release on a Spark cluster through spark-submit, shipping the dprelease package to executors.
# Usage: submit.sh MASTER_URL SPEC [dprelease run options] [-- extra spark-submit options]
# The package (with its compiled sampler kernel) is zipped from this installation and shipped with
# --archives; executors import it from the extracted folder. They need the same Python version and
# platform, and numpy, pyarrow, cryptography, pydantic and PyYAML (or ship a packed venv instead, see
# deploy/spark/README.md).
set -euo pipefail
master="${1:?usage: submit.sh MASTER_URL SPEC [run options] [-- spark-submit options]}"
spec="${2:?usage: submit.sh MASTER_URL SPEC [run options] [-- spark-submit options]}"
shift 2
run_args=() submit_args=()
while [ "$#" -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; submit_args=("$@"); break; fi
  run_args+=("$1"); shift
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
exec "$spark_home/bin/spark-submit" --master "$master" \
  --archives "$stage/dprelease-package.zip#dprelease_package" \
  --conf spark.executorEnv.PYTHONPATH=dprelease_package \
  --conf "spark.pyspark.python=$("$python" -c 'import sys; print(sys.executable)')" \
  "${submit_args[@]}" \
  "$here/launcher.py" run "$spec" --engine spark "${run_args[@]}"

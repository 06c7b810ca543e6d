#!/usr/bin/env bash
# Start a Spark standalone master and N workers on 127.0.0.1 from the pip pyspark installation.
# Usage: start-cluster.sh RUN_DIR [WORKERS=2] [PORT=7077]
# Writes RUN_DIR/master.pid, RUN_DIR/worker-*.pid, logs, and RUN_DIR/master-url; prints the master URL.
set -euo pipefail
run_dir="${1:?usage: start-cluster.sh RUN_DIR [WORKERS] [PORT]}"
workers="${2:-2}"
port="${3:-7077}"
python="${PYTHON:-python3}"
spark_home="$("$python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"
mkdir -p "$run_dir"
export SPARK_HOME="$spark_home" SPARK_LOCAL_IP=127.0.0.1 SPARK_NO_DAEMONIZE=1
url="spark://127.0.0.1:$port"
nohup "$spark_home/bin/spark-class" org.apache.spark.deploy.master.Master \
  --host 127.0.0.1 --port "$port" --webui-port 0 >"$run_dir/master.log" 2>&1 &
echo $! >"$run_dir/master.pid"
for _ in $(seq 1 120); do
  grep -q "I have been elected leader" "$run_dir/master.log" 2>/dev/null && break
  sleep 0.5
done
grep -q "I have been elected leader" "$run_dir/master.log" || { echo "master did not start; see $run_dir/master.log" >&2; exit 1; }
for i in $(seq 1 "$workers"); do
  mkdir -p "$run_dir/work-$i"
  nohup "$spark_home/bin/spark-class" org.apache.spark.deploy.worker.Worker \
    --host 127.0.0.1 --cores 1 --memory 2g --webui-port 0 --work-dir "$run_dir/work-$i" "$url" \
    >"$run_dir/worker-$i.log" 2>&1 &
  echo $! >"$run_dir/worker-$i.pid"
done
for i in $(seq 1 "$workers"); do
  for _ in $(seq 1 120); do
    grep -q "Successfully registered with master" "$run_dir/worker-$i.log" 2>/dev/null && break
    sleep 0.5
  done
  grep -q "Successfully registered with master" "$run_dir/worker-$i.log" || { echo "worker $i did not register; see $run_dir/worker-$i.log" >&2; exit 1; }
done
echo "$url" >"$run_dir/master-url"
echo "$url"

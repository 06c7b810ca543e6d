"""The Spark engine: byte-identical to the embedded engine on local[2] and on a real standalone
cluster (master + 2 workers on 127.0.0.1 started by deploy/spark), and safe under task retries."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from dprelease.accounting.errors import SpecError
from dprelease.pipelines.commands import demo_data
from dprelease.pipelines.dataflow import Flow, stage_order
from dprelease.pipelines.layout import Layout
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.run import run_release
from dprelease.pipelines.spec import load_spec
from dprelease.pipelines.storage import downloaded
from dprelease.pipelines.verify import verify_release

from .conftest import DEMO_SPEC, REPO
from .test_storage import credentials, s3  # noqa: F401 - fixtures

pytest.importorskip("pyspark")
pytestmark = pytest.mark.skipif(subprocess.run(["which", "java"], capture_output=True).returncode != 0,
                                reason="no Java runtime")

ROWS = 60_000


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("spark")
    data, _ = demo_data(ROWS, root / "data", seed=7)
    key = root / "demo.key"
    embedded = run_release(DEMO_SPEC, input_path=str(data), out_dir=root / "embedded", key_file=key)
    return {"root": root, "data": data, "key": key, "embedded": embedded.release_dir}


def run_cli_to_files(arguments: list, stem: Path) -> subprocess.CompletedProcess:
    """`dprelease ARGUMENTS` with its output in files (STEM.stdout, STEM.stderr), read back as text: returns when
    the command exits (with pipes, it would wait until every process holding them, a lingering JVM too, exits)."""
    with open(f"{stem}.stdout", "w") as stdout, open(f"{stem}.stderr", "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, arguments)], stdout=stdout,
                              stderr=stderr)
    return subprocess.CompletedProcess(done.args, done.returncode, Path(f"{stem}.stdout").read_text(),
                                       Path(f"{stem}.stderr").read_text())


def processes_marked(mark: str) -> list[int]:
    """PIDs of the live processes whose environment holds `mark` (NAME=VALUE), from /proc (Linux)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def assert_same_release(a: Path, b: Path, engine: str) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        if rel.name != "manifest.json":
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert mb["engine"] == engine
    for m in (ma, mb):
        m.pop("provenance"), m.pop("engine")
    assert ma == mb


def test_spark_local_is_byte_identical_to_embedded(demo):
    result = run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=demo["root"] / "local",
                         key_file=demo["key"], engine="spark", master="local[2]")
    assert_same_release(demo["embedded"], result.release_dir, "spark")


def test_spark_retries_redraw_nothing(demo, monkeypatch):
    """The hook really fails attempt 0 (no retry on local[2]: exit 1), and what Spark prints of the executor's
    failure (log4j's task lines, the driver's error) names the step and the exception's type, never its text;
    with retries the release is the embedded engine's. Failed or not, the command returns only once the JVM it
    launched and that JVM's Python workers (which held records and the key) are gone."""
    monkeypatch.setenv("DPRELEASE_TEST_FAIL_FIRST_ATTEMPT", "noise")
    mark = f"DPRELEASE_TEST_RUN={os.urandom(8).hex()}"  # inherited by every process the run starts
    monkeypatch.setenv(*mark.split("="))
    failed = run_cli_to_files(["run", DEMO_SPEC, "--no-ledger", "--input", demo["data"], "--out",
                               demo["root"] / "no-retry", "--key-file", demo["key"], "--engine", "spark",
                               "--master", "local[2]"], demo["root"] / "no-retry.out")
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "noise failed in a worker: RuntimeError" in failed.stderr  # log4j's lines: the public text only
    assert "test hook" not in failed.stdout + failed.stderr
    assert not (demo["root"] / "no-retry").exists() or not any((demo["root"] / "no-retry").rglob("manifest.json"))
    assert processes_marked(mark) == []
    retried = run_cli_to_files(["run", DEMO_SPEC, "--no-ledger", "--input", demo["data"], "--out",
                                demo["root"] / "retried", "--key-file", demo["key"], "--engine", "spark",
                                "--master", "local[2,4]"], demo["root"] / "retried.out")
    assert retried.returncode == 0, retried.stderr[-2000:]
    assert processes_marked(mark) == []  # the JVM and its Python workers exited before the command returned
    assert_same_release(demo["embedded"], next((demo["root"] / "retried").iterdir()), "spark")


def test_shuffled_blobs_stay_under_the_binary_offset_limit(demo, monkeypatch):
    """Spark's binary columns have 32-bit offsets, so the blobs an executor hands Spark are split by rows past
    BLOB_BYTES and batched by at most BLOBS_BATCH_BYTES (here a few KB, so many records' sizes pass them): each
    partition receives the same records as with one blob per part and batch."""
    import pyarrow as pa

    from dprelease.pipelines.engines import spark as engine
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.source import open_input
    from dprelease.pipelines.spec import load_spec

    plan = build_plan(*load_spec(DEMO_SPEC))
    source = open_input(plan, DEMO_SPEC.parent, str(demo["data"]))
    tasks = source.read_tasks()

    def partitions() -> tuple[list[pa.RecordBatch], dict[int, pa.Table]]:
        encode = engine._encode_shard_function(source.reader(), tasks, plan, source.unit_column, 7, 3)
        batches = list(encode(iter([pa.record_batch({"task": list(range(len(tasks)))})])))
        records = {}
        for part in engine.partition_labels(3):  # each shard's label (one shard to a Spark partition)
            mine = [b.filter(pa.compute.equal(b.column("part"), part)) for b in batches]
            codes, rows, units = engine._blob_records(mine, plan.encoded_columns(), source.unit_column)
            table = pa.table({**codes, "unit": units.combine_chunks()})
            records[part] = table.sort_by([(c, "ascending") for c in table.column_names])
        return batches, records

    whole_batches, whole = partitions()
    monkeypatch.setattr(engine, "BLOB_BYTES", 4096)
    monkeypatch.setattr(engine, "BLOBS_BATCH_BYTES", 16384)
    capped_batches, capped = partitions()
    assert len(capped_batches) > 10 * len(whole_batches)
    for batch in capped_batches:
        sizes = [len(blob) for blob in batch.column("blob").to_pylist()]
        assert sum(sizes) <= 16384 or len(sizes) == 1
        assert max(sizes) < 4096 + 2048  # the IPC stream's schema and framing over the records' bytes
    assert capped.keys() == whole.keys() and all(capped[p].equals(whole[p]) for p in whole)
    assert sum(t.num_rows for t in whole.values()) > 0
    assert "spark.sql.execution.arrow.maxBytesPerBatch" in engine.ARROW_SETTINGS  # the batches Spark hands back


def test_blobs_are_cut_by_the_bytes_of_their_records(monkeypatch):
    """Found by review: cut by the average record, records of large units sitting together made one blob 5.5x the
    cap. Cut by each record's bytes, a blob passes BLOB_BYTES only when it is one record larger than it; every
    record is in one blob, in order."""
    import numpy as np
    import pyarrow as pa

    from dprelease.pipelines.engines import spark as engine

    monkeypatch.setattr(engine, "BLOB_BYTES", 4096)
    units = [b"u%d" % i for i in range(300)] + [b"x" * 900 + b"%d" % i for i in range(40)] + [b"y" * 9000]
    records = pa.table({"age": np.arange(len(units), dtype=np.int32), "__unit__": pa.array(units, pa.large_binary())})
    blobs = [pa.ipc.open_stream(blob).read_all() for _, blob in engine._part_blobs(iter([(3, records)]))]
    assert pa.concat_tables(blobs).equals(records)
    for table in blobs:
        assert sum(len(u) + 12 for u in table.column("__unit__").to_pylist()) <= 4096 or table.num_rows == 1
    assert [t.num_rows for t in blobs][-1] == 1 and len(blobs) > 10


def test_a_range_adds_every_tasks_partial_counts_batch_by_batch():
    """Found by review: a range's release task concatenated every counting task's copy of the range (memory grew
    with the tasks). It now adds each task's row into the range as Spark hands the batches over; the sums are
    those of all the partial counts, the range's marker (no count) included, and repeats across tasks add up."""
    import numpy as np
    import pyarrow as pa

    from dprelease.pipelines.engines.spark import _range_counts, _sparse_counts

    class Release:
        n_measured = 1000

    rng = np.random.default_rng(4)
    steps = [300]
    partials = [np.where(rng.random(1000) < 0.3, rng.integers(1, 9, 1000), 0) for _ in range(40)]  # 40 tasks
    rows = pa.Table.from_batches([_sparse_counts(0, counts, steps) for counts in partials])
    in_range = rows.filter(pa.compute.equal(rows["range_id"], 2))
    marker = pa.table({"table_id": pa.array([0], pa.int32()), "range_id": pa.array([2], pa.int64()),
                       "cells": pa.array([b""]), "counts": pa.array([b""])})
    batches = pa.concat_tables([marker, in_range]).to_batches(max_chunksize=7)
    table_id, start, stop, measured = _range_counts([Release()], steps, iter(batches))
    assert (table_id, start, stop) == (0, 600, 900) and len(batches) > 4
    assert np.array_equal(measured, sum(partials)[600:900])  # every task's counts of the range, added


def test_spark_post_processes_and_writes_parts_in_executors(demo, monkeypatch):
    """Small groups and parts: every post-processing stage runs in executor tasks (each group's first attempt
    fails after writing its parts, the retry rewrites the same bytes) under a driver cell cap far below the
    release's; the release equals the embedded engine's with the same layout, and verifies."""
    layout = Layout(group_work=512, part_rows=64)
    embedded = run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=demo["root"] / "embedded-parts",
                           key_file=demo["key"], layout=layout)
    stages = []
    monkeypatch.setenv("DPRELEASE_TEST_FAIL_FIRST_ATTEMPT", "groups")
    result = run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=demo["root"] / "spark-parts",
                         key_file=demo["key"], engine="spark", master="local[2,4]", layout=layout,
                         progress=lambda stage, done, total: stages.append((stage, done, total)),
                         max_cells=1000)  # the cap is the driver's: no cell reaches it on this path
    flow = Flow(build_plan(*load_spec(DEMO_SPEC)), layout, "")
    expected = len(stage_order(flow))  # up and down over 4 levels, steps of one group fused; the per-cell parts first
    assert 1 < expected < 9 and ("post-process", expected, expected) in stages
    assert any(len(run) > 1 for run in flow.runs) and any(len(run) == 1 for run in flow.runs)
    assert len(list(result.release_dir.glob("tables/*/part-*.parquet"))) > 10
    assert_same_release(embedded.release_dir, result.release_dir, "spark")
    assert verify_release(result.release_dir).ok


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_standalone_cluster_release(demo, s3, credentials):
    """Two workers with their own work directories: the release written to a directory the driver names (local
    disk, shared on this machine), then to an S3-compatible store on 127.0.0.1, where the executors write every
    part straight into the run's staging prefix (`storage.staging`: nothing shared with the driver is needed),
    credentials from the environment the cluster was started with. Both equal the embedded engine's release."""
    run_dir = demo["root"] / "cluster-run"
    env = {**os.environ, "PYTHON": sys.executable}  # with the store's credentials (`credentials`)
    started = subprocess.run(["bash", str(REPO / "deploy/spark/start-cluster.sh"), str(run_dir), "2", str(_free_port())],
                             capture_output=True, text=True, env=env, timeout=180)
    pids = [int(p.read_text()) for p in run_dir.glob("*.pid")]
    try:
        assert started.returncode == 0, started.stderr + "".join(p.read_text() for p in run_dir.glob("*.log"))
        url = started.stdout.strip().splitlines()[-1]
        assert url.startswith("spark://127.0.0.1:") and len(pids) == 3
        submitted = subprocess.run(
            ["bash", str(REPO / "deploy/spark/submit.sh"), url, str(DEMO_SPEC), "--input", str(demo["data"]),
             "--out", str(demo["root"] / "cluster"), "--key-file", str(demo["key"]), "--no-ledger"],
            capture_output=True, text=True, env=env, timeout=600)
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        assert_same_release(demo["embedded"], demo["root"] / "cluster" / "demo-2026", "spark")
        bucket = pafs.S3FileSystem(endpoint_override=s3, scheme="http", allow_bucket_creation=True)
        bucket.create_dir("cluster")
        out = f"s3://cluster/releases?endpoint_override={s3}&scheme=http"
        submitted = subprocess.run(
            ["bash", str(REPO / "deploy/spark/submit.sh"), url, str(DEMO_SPEC), "--input", str(demo["data"]),
             "--out", out, "--key-file", str(demo["key"]), "--no-ledger"],
            capture_output=True, text=True, env=env, timeout=600)
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        names = [i.path for i in bucket.get_file_info(pafs.FileSelector("cluster", recursive=True))
                 if i.type == pafs.FileType.File]
        assert names and all(n.startswith("cluster/releases/demo-2026/") for n in names)  # no staging left
        with downloaded(f"s3://cluster/releases/demo-2026?endpoint_override={s3}&scheme=http") as copy:
            assert_same_release(demo["embedded"], copy.path, "spark")
            assert verify_release(copy.path).ok
        worker_logs = "".join(p.read_text() for p in run_dir.glob("worker-*.log"))
        assert worker_logs.count("Asked to launch executor") >= 2  # both workers ran executors
    finally:
        stopped = subprocess.run(["bash", str(REPO / "deploy/spark/stop-cluster.sh"), str(run_dir)], timeout=120)
    assert stopped.returncode == 0
    assert not any(_alive(pid) for pid in pids)


def test_master_needs_the_spark_engine(tmp_path):
    with pytest.raises(SpecError, match="--master"):
        run_release(DEMO_SPEC, out_dir=tmp_path, master="local[2]", input_path=str(tmp_path / "x.parquet"),
                    engine="embedded")


def test_missing_pyspark_is_a_clear_error(monkeypatch):
    from dprelease.pipelines.engines import spark as spark_engine

    monkeypatch.setitem(sys.modules, "pyspark", None)
    with pytest.raises(SpecError, match=r'pip install "dprelease\[spark\]"'):
        spark_engine._import_pyspark()


def test_input_validation_runs_on_the_spark_dataframe(case, tmp_path):
    """The value-level suite runs on Spark (a Spark DataFrame batch) and counts what pandas counts."""
    pytest.importorskip("great_expectations")
    from .test_validation import DIRTY, internal_report

    spec_path = case(rows=DIRTY)
    reports = {}
    for engine in ("embedded", "spark"):
        result = run_release(spec_path, engine=engine, master="local[2]" if engine == "spark" else None,
                             out_dir=tmp_path / engine, key_file=tmp_path / "k.key",
                             internal_dir=tmp_path / f"{engine}-internal")
        assert json.loads((result.release_dir / "manifest.json").read_text())["input_validation"]["expectations"] > 0
        reports[engine] = internal_report(tmp_path / f"{engine}-internal")
    assert reports["spark"]["engine"] == "spark" and reports["spark"]["success"] is False
    counts = {e: [(x["type"], x["kwargs"]["column"], x.get("unexpected_count")) for x in r["expectations"]]
              for e, r in reports.items()}
    assert counts["spark"] == counts["embedded"]


def test_column_types_spark_cannot_read_are_refused_before_any_reservation(case, tmp_path):
    """A uint64 column, or a later file whose column type differs from the first file's, made the Spark
    job fail mid-run (after the reservation); both are public schema facts: exit 2 up front."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dprelease.accounting.errors import InputSchemaError
    from dprelease.accounting.ledger import history, open_ledger, set_budget
    from .conftest import GEO_LEAVES

    rows = {"pid": pa.array([1, 2], pa.uint64()), "geo": GEO_LEAVES[:2], "age": [10, 40], "sex": ["F", "M"]}
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", 5)
    with pytest.raises(InputSchemaError, match="'pid': type uint64 cannot be read by the spark engine"):
        run_release(case(rows=rows), engine="spark", ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "o")
    spec = case(input={"path": "parts"})
    (spec.parent / "parts").mkdir()
    pq.write_table(pa.table(rows | {"pid": pa.array([1, 2], pa.int64())}), spec.parent / "parts" / "a.parquet")
    pq.write_table(pa.table(rows | {"pid": pa.array([3, 4], pa.int32())}), spec.parent / "parts" / "b.parquet")
    with pytest.raises(InputSchemaError, match="b.parquet: column 'pid' is int32, the first file's is int64"):
        run_release(spec, engine="spark", ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "o")
    assert history(open_ledger(book), "test-data")[1] == [] and not (tmp_path / "k.key").exists()


def test_python_api_runs_on_the_callers_session_and_leaves_it_running(demo, tmp_path):
    """`Release.run(spark_dataframe)`: the spark engine on the caller's session (input validation included), which
    is neither stopped nor left with the engine's settings."""
    import dprelease
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("a user's notebook")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "1000").getOrCreate())
    try:
        frame = spark.read.parquet(str(demo["data"]))
        release = dprelease.Release.from_yaml(DEMO_SPEC)
        with pytest.raises(dprelease.SpecError, match="a Spark DataFrame runs on the spark engine"):
            release.run(frame, engine="embedded", ledger=None, out_dir=tmp_path)
        with pytest.raises(dprelease.SpecError, match="spark_staging"):  # never inside the output directory
            release.run(frame, ledger=None, out_dir=tmp_path, spark_staging=tmp_path / "staging")
        (tmp_path.parent / "staging").mkdir(exist_ok=True)
        result = release.run(frame, ledger=None, out_dir=tmp_path, spark_staging=tmp_path.parent / "staging",
                             key_file=demo["root"] / "api.key", internal_dir=tmp_path.parent / "internal")
        assert result.manifest["engine"] == "spark"
        assert result.verify().ok
        nation = result.table("population.nation")
        assert abs(int(nation["count"].iloc[0]) - ROWS) < 0.01 * ROWS
        assert spark.range(5).count() == 5  # still running
        # the shards' labels go one to a partition under Spark's own hash partitioning (`partition_labels`)
        from dprelease.pipelines.engines.spark import partition_labels
        for partitions in (1, 2, 5, 7, 64):
            labels = spark.createDataFrame([(v,) for v in partition_labels(partitions)], "part int")
            slots = [r[0] for r in labels.selectExpr(f"pmod(hash(part), {partitions})").collect()]
            assert slots == list(range(partitions))
            spread = labels.repartition(partitions, "part").rdd.glom().map(len).collect()
            assert spread == [1] * partitions
        assert spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch") == "1000"
        assert [p.name for p in tmp_path.iterdir()] == ["demo-2026"]
        assert list((tmp_path.parent / "staging").iterdir()) == []  # the staged input copy is gone
        with pytest.raises(SpecError, match="already runs a Spark session"):
            run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=tmp_path / "other", engine="spark",
                        master="local[1]")
    finally:
        spark.stop()


def test_an_interrupted_copy_job_is_cancelled_and_the_session_stays_in_step():
    """The job that copies staged parts into a release runs on a thread of its own: a signal in the driver raises
    at once (it used to wait, inside a py4j call, for the whole job: every copy, up to the store's timeout), the
    job's tasks are cancelled, and the driver's connection to the JVM still answers in step."""
    import os
    import signal
    import threading
    import time

    from pyspark.sql import SparkSession

    from dprelease.pipelines.engines.spark import _copy_job

    class Stopped(Exception):
        pass

    def stopped(signum, frame):
        raise Stopped

    session = SparkSession.builder.master("local[2]").getOrCreate()
    context = session.sparkContext
    previous = signal.signal(signal.SIGUSR1, stopped)
    try:
        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Stopped):
            _copy_job(context, context.parallelize(range(2), 2).map(lambda x: time.sleep(300) or x))
        assert list(context.statusTracker().getActiveJobsIds()) == []  # cancelled, not left running
        assert session.range(5).count() == 5
    finally:
        signal.signal(signal.SIGUSR1, previous)
        session.stop()


def test_a_copy_job_interrupted_before_it_was_submitted_never_runs(tmp_path):
    """A signal between the copy thread's start and its job's submission (where there is no job to cancel yet):
    the thread submits nothing, so no copy runs after the clean-up."""
    import os
    import signal
    import threading
    import time

    from pyspark.sql import SparkSession

    from dprelease.pipelines.engines.spark import _copy_job

    class Stopped(Exception):
        pass

    def stopped(signum, frame):
        raise Stopped

    class SlowToGroup:
        def __init__(self, context):
            self.context = context

        def setJobGroup(self, *args, **kwargs):  # noqa: N802 - pyspark's name
            time.sleep(2.0)
            self.context.setJobGroup(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.context, name)

    session = SparkSession.builder.master("local[2]").getOrCreate()
    context = session.sparkContext
    marker = tmp_path / "copied"
    previous = signal.signal(signal.SIGUSR1, stopped)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Stopped):
            _copy_job(SlowToGroup(context), context.parallelize(range(2), 2).map(lambda x: marker.touch() or x))
        time.sleep(3.0)  # past the group's setting: a job submitted then would have run by now
        assert not marker.exists()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        session.stop()


SESSION_JVM_OPTIONS = """
import pathlib, sys
from dprelease.pipelines.engines.spark import SparkEngine
engine = SparkEngine(master=sys.argv[1])
spark = engine.session()
jvm = spark.sparkContext._gateway.proc.pid
print(spark.sparkContext.getConf().get("spark.driver.defaultJavaOptions", "unset"))
print("TieredStopAtLevel=1" in pathlib.Path(f"/proc/{jvm}/cmdline").read_text())
import gc, pyarrow as pa
from dprelease.pipelines.engines.spark import _worker_function
def probe(batches):
    for batch in batches:
        yield pa.record_batch({"frozen": [gc.get_freeze_count()]})
print(min(row[0] for row in spark.range(1).mapInArrow(_worker_function("probe", probe), "frozen long").collect()) > 0)
engine.close()
"""


@pytest.mark.parametrize("configured", [False, True])
def test_a_local_session_the_engine_starts_uses_the_quick_jit_unless_the_deployment_sets_the_jvm_options(
        tmp_path, configured):
    """A local session the engine starts runs its JVM with the quick JIT compiler only (`LOCAL_JVM_OPTIONS`); a
    deployment's own `spark.driver.defaultJavaOptions` in spark-defaults.conf is kept, not replaced. An executor's
    Python worker freezes the objects it imported out of the collector's reach on its first task."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONF_DIR", "PYSPARK_SUBMIT_ARGS")}
    if configured:
        (tmp_path / "spark-defaults.conf").write_text("spark.driver.defaultJavaOptions -Dmarked.by.test=1\n")
        env["SPARK_CONF_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", SESSION_JVM_OPTIONS, "local[1]"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    options, quick, frozen = done.stdout.split()
    assert (options, quick) == (("-Dmarked.by.test=1", "False") if configured else ("-XX:TieredStopAtLevel=1", "True"))
    assert frozen == "True"


def test_the_deployments_jvm_options_are_found_without_waiting_on_a_fifo_or_reading_a_directory(tmp_path, monkeypatch):
    """`_jvm_options_configured` reads spark-defaults.conf only when it is a regular file (a FIFO put in its place
    would block a plain read for ever), and finds the setting there, in PYSPARK_SUBMIT_ARGS (or a properties file
    named there) or a tiered-compilation flag in the JVM's option variables; a file too large to search counts as
    setting it. Only a local master's one JVM gets the quick JIT."""
    from dprelease.pipelines.engines.spark import (SPARK_DEFAULTS_BYTES, _jvm_options_configured, _quick_jit_master,
                                                   _spark_conf_directory)

    for name in ("PYSPARK_SUBMIT_ARGS", "SPARK_SUBMIT_OPTS", "JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    defaults = tmp_path / "spark-defaults.conf"
    assert not _jvm_options_configured()  # none there
    os.mkfifo(defaults)
    assert not _jvm_options_configured()  # returns at once: no writer is ever opened
    defaults.unlink()
    defaults.mkdir()
    assert not _jvm_options_configured()
    defaults.rmdir()
    defaults.write_text("spark.master local[1]\nspark.driver.defaultJavaOptions -Xss4m\n")
    assert _jvm_options_configured()
    defaults.write_text("spark.master local[1]\n")
    assert not _jvm_options_configured()
    defaults.write_bytes(b"#" * SPARK_DEFAULTS_BYTES + b"\nspark.driver.defaultJavaOptions -Xss4m\n")
    assert _jvm_options_configured()  # too large to search: counted as set, never replaced
    defaults.write_text("spark.master local[1]\n")
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:-TieredCompilation")
    assert _jvm_options_configured()
    monkeypatch.delenv("JAVA_TOOL_OPTIONS")
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--properties-file prod.conf pyspark-shell")
    assert _jvm_options_configured()
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--conf spark.driver.defaultJavaOptions=-Xss4m pyspark-shell")
    assert _jvm_options_configured()
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    import pyspark  # without SPARK_CONF_DIR or SPARK_HOME: the installed pyspark's conf/, as spark-submit reads it
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv("SPARK_HOME", "")
    assert _spark_conf_directory() == os.path.join(os.path.dirname(pyspark.__file__), "conf")
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    assert [_quick_jit_master(m) for m in ("local", "local[2]", "local[*]", "local-cluster[2,1,1024]", "spark://h:7077",
                                           "yarn", None)] == [True, True, True, False, False, False, False]
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "40000")  # under spark-submit the JVM already runs
    assert not _quick_jit_master("local[2]")

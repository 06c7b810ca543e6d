"""A release published to a store by a distributed engine: the workers write every part straight into a staging
prefix of the run in the store (no disk shared with the driver), the driver checks exactly what they reported,
copies the parts into the release inside the store and uploads the manifest last; a failure leaves nothing
(or is charged when it cannot remove what it staged), and a dead run's prefix is removed by the next run.
Against a real S3-compatible server on 127.0.0.1 (moto's, as in test_storage); the cluster case is in test_spark."""
from __future__ import annotations

import hashlib
import json
from fractions import Fraction

import boto3
import pyarrow as pa
import pytest

from dprelease.accounting.errors import DPReleaseError, PublishError
from dprelease.accounting.ledger import COMMITTED, open_ledger, set_budget
from dprelease.pipelines import release as release_module
from dprelease.pipelines import run as run_module
from dprelease.pipelines.dataflow import Flow
from dprelease.pipelines.housekeeping import host_identity
from dprelease.pipelines.layout import Part
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.run import run_release
from dprelease.pipelines.spec import load_spec
from dprelease.pipelines.storage import (STAGING_MARKER, StagedPartsLeft, check_remote_staged, downloaded,
                                         new_remote_staging, open_remote_staging, put_part, release_under)
from dprelease.pipelines.verify import verify_release

from .conftest import small_spec, write_case
from .test_key_reuse import statuses
from .test_remote_outputs import bucket_uri, objects, store
from .test_spark import assert_same_release
from .test_storage import credentials, s3  # noqa: F401 - fixtures

TREE_SPEC = small_spec(queries=small_spec()["queries"][:2])
"""A hierarchy and marginals within state: count tables that form a tree of units, written by the workers."""


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded engine's release of TREE_SPEC on local disk, and its key."""
    root = tmp_path_factory.mktemp("embedded")
    spec = write_case(root / "case", TREE_SPEC)
    key = root / "tree.key"
    return spec, key, run_release(spec, key_file=key, out_dir=root / "out", engine="embedded").release_dir


def engine_options(engine: str) -> dict:
    """run_release's options for `engine` against the test store: for Spark a local[2] session whose executors
    hold the store's credentials (local executors take their environment from the JVM, which an earlier test may
    have started before the credentials were set: handed over as a cluster's workers would have them)."""
    if engine == "beam":
        pytest.importorskip("apache_beam")
        return {}
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    stale = SparkSession.getActiveSession()
    if stale is not None:
        stale.stop()
    return {"spark_session": SparkSession.builder.master("local[2]")
            .config("spark.executorEnv.AWS_ACCESS_KEY_ID", "testing")
            .config("spark.executorEnv.AWS_SECRET_ACCESS_KEY", "testing").getOrCreate()}


@pytest.mark.parametrize("engine", ["spark", "beam"])
def test_the_workers_write_into_the_store_and_the_release_equals_the_embedded_one(engine, embedded, s3, credentials,
                                                                                 tmp_path, monkeypatch):
    """The workers also copy the parts into the release and read them back (the driver reads none of their bytes:
    the commit scales with the cluster)."""
    from dprelease.pipelines.storage import objects as objects_module

    read_back = []
    digest = objects_module._object_sha256
    monkeypatch.setattr(objects_module, "_object_sha256", lambda fs, path: read_back.append(path) or digest(fs, path))
    options = engine_options(engine)
    spec, key, local = embedded
    bucket = f"staged-{engine}"
    try:
        done = run_release(spec, key_file=key, out_dir=bucket_uri(s3, bucket), engine=engine, **options)
    finally:
        if options:
            options["spark_session"].stop()
    with downloaded(done.release_dir) as copy:
        assert_same_release(local, copy.path, engine)
        assert verify_release(copy.path).ok
        parts = [p for p in copy.path.rglob("*") if p.is_file() and p.parent.name in FOLDERS]
    assert read_back == [] and parts
    # nothing but the release under the output prefix: the staging prefix is gone
    assert all(name.startswith("test-release/") for name in objects(s3, f"{bucket}/releases"))


def test_a_failure_after_the_workers_wrote_removes_the_staging_prefix_and_stays_charged(s3, credentials, tmp_path,
                                                                                       monkeypatch):
    """Charged before the workers start (noisy values go where a killed driver or a versioned bucket could leave
    them): a failure removes the prefix, is never refunded, and a re-run with the key publishes free."""
    pytest.importorskip("apache_beam")
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    spec = write_case(tmp_path / "case", TREE_SPEC)
    seen = []

    def fail(plan, staging, entries, **record):
        seen.extend(objects(s3, "failed/releases"))
        raise RuntimeError("driver failed after the workers wrote")

    with monkeypatch.context() as patched:  # undone at its end (the credentials stay)
        patched.setattr(run_module, "finish_release", fail)
        with pytest.raises(PublishError, match="charged in the ledger when its staging in the store started"):
            run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=bucket_uri(s3, "failed"),
                        engine="beam")
    assert any(name.endswith(".parquet") for name in seen)  # the parts were in the store
    assert objects(s3, "failed/releases") == []
    assert statuses(book) == [COMMITTED]
    again = run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=bucket_uri(s3, "failed"),
                        engine="beam", overwrite=False)
    with downloaded(again.release_dir) as copy:
        manifest = json.loads((copy.path / "manifest.json").read_text())
        assert manifest["ledger"]["charged_by_this_run"] == "0" and verify_release(copy.path).ok
    assert statuses(book) == [COMMITTED]


def test_staged_parts_that_cannot_be_removed_are_named_and_the_run_is_charged(s3, credentials, tmp_path,
                                                                              monkeypatch):
    pytest.importorskip("apache_beam")
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    spec = write_case(tmp_path / "case", TREE_SPEC)
    monkeypatch.setattr(run_module, "finish_release", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("late")))
    monkeypatch.setattr(release_module, "remove_remote_staging", lambda staging: ["left/part.parquet"])
    with pytest.raises(PublishError, match="1 staged object.*could not be removed.*the run is charged") as raised:
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=bucket_uri(s3, "stuck"), engine="beam")
    assert isinstance(raised.value.__cause__, StagedPartsLeft)
    assert statuses(book) == [COMMITTED]  # noisy values stay readable: never refunded


def test_the_next_run_removes_a_dead_runs_staging_prefix_and_no_other(s3, credentials, tmp_path):
    pytest.importorskip("apache_beam")
    out = bucket_uri(s3, "stale")
    here = host_identity()
    dead = f"stale/releases/.test-release.staging+999999999.1+{here}+0a0b0c0d"
    elsewhere = "stale/releases/.test-release.staging+12.34+another-host+0a0b0c0d"
    unparsed = f"stale/releases/.test-release.staging+notatoken+{here}+0a0b0c0d"
    for prefix in (dead, elsewhere, unparsed):
        for name in (STAGING_MARKER, "tables/pop.nation.parquet"):
            with store(s3).open_output_stream(f"{prefix}/{name}") as handle:
                handle.write(b"left by a killed run")
    spec = write_case(tmp_path / "case", TREE_SPEC)
    run_release(spec, key_file=tmp_path / "k.key", out_dir=out, engine="beam")
    names = objects(s3, "stale/releases")
    assert not any(name.startswith(dead.rsplit("/", 1)[1]) for name in names)
    assert f"{elsewhere.rsplit('/', 1)[1]}/{STAGING_MARKER}" in names  # another host's: cannot be told dead
    assert f"{unparsed.rsplit('/', 1)[1]}/{STAGING_MARKER}" in names  # no owner in its name: never removed
    assert "test-release/manifest.json" in names


FOLDERS = ("tables", "measurements", "debiased")


def writing(data: bytes):
    return lambda sink: sink.write(data)


def _staging(s3, bucket: str):
    release = release_under(bucket_uri(s3, bucket), "r", "--out")
    return new_remote_staging(release, ".r.staging+", "1.2+host+")


def test_a_worker_writes_nothing_where_the_marker_is_not_its_runs(s3, credentials, tmp_path):
    staging = _staging(s3, "tokens")
    with pytest.raises(DPReleaseError, match="not this run's"):
        open_remote_staging(staging.uri, "0" * 32)
    spec = write_case(tmp_path, TREE_SPEC)
    flow = Flow(build_plan(*load_spec(spec)), None, staging.uri, staging_token="f" * 32)
    with pytest.raises(DPReleaseError, match="nothing was written"):
        flow.write(Part("tables/t", 0, 1), pa.table({"count": [1]}))
    assert objects(s3, staging.path) == [STAGING_MARKER]
    assert open_remote_staging(staging.uri, staging.token).path == staging.path


def test_the_driver_publishes_only_exactly_what_the_workers_reported(s3, credentials):
    staging = _staging(s3, "reports")
    entries = [put_part(staging, "tables/a.csv", writing(b"a,b\n")), put_part(staging, "tables/b.csv", writing(b"c\n"))]
    assert entries[0] == {"path": "tables/a.csv", "sha256": hashlib.sha256(b"a,b\n").hexdigest(), "bytes": 4}
    check_remote_staged(staging, entries, FOLDERS)
    with pytest.raises(DPReleaseError, match="reported a release file twice"):
        check_remote_staged(staging, entries + entries[:1], FOLDERS)
    with pytest.raises(DPReleaseError, match="not found .* with its size"):
        check_remote_staged(staging, [entries[0], {**entries[1], "bytes": 3}], FOLDERS)
    with pytest.raises(DPReleaseError, match="no worker reported"):
        check_remote_staged(staging, entries[:1], FOLDERS)
    with pytest.raises(DPReleaseError, match="not found"):
        check_remote_staged(staging, entries + [{"path": "tables/c.csv", "sha256": "0" * 64, "bytes": 1}], FOLDERS)
    with pytest.raises(DPReleaseError, match="2 file.*outside the release's folders"):
        check_remote_staged(staging, entries, ("measurements", "debiased"))
    with pytest.raises(ValueError, match="not a plain"):
        put_part(staging, "../escape.csv", writing(b"x"))
    with pytest.raises(ValueError, match="not a plain"):
        put_part(staging, STAGING_MARKER, writing(b"x"))
    boto3.client("s3", endpoint_url=f"http://{s3}").put_object(
        Bucket="reports", Key=f"{staging.path.split('/', 1)[1]}/tables/../tables/a.csv", Body=b"a,b\n")
    with pytest.raises(DPReleaseError, match="1 object.* not plain"):
        check_remote_staged(staging, entries, FOLDERS)


@pytest.mark.parametrize("engine", ["spark", "beam"])
def test_a_part_rewritten_in_the_store_after_the_check_is_never_published(engine, s3, credentials, tmp_path,
                                                                          monkeypatch):
    """A late task attempt (or anyone) rewriting a staged part with other bytes of the same size after the driver's
    check: the copy in the release is read back by the workers and its SHA-256 compared by the driver with the
    writing worker's, so no manifest is uploaded."""
    options = engine_options(engine)
    spec = write_case(tmp_path / "case", TREE_SPEC)
    check = run_module.check_remote_staged

    def check_then_rewrite(parts, entries, folders):
        check(parts, entries, folders)
        name = next(e["path"] for e in entries if e["path"].endswith(".csv"))
        with parts.store.filesystem.open_input_stream(parts.object_path(name)) as handle:
            data = handle.read()
        with parts.store.filesystem.open_output_stream(parts.object_path(name)) as handle:
            handle.write(data[:-2] + (b"7\n" if data[-2:] != b"7\n" else b"8\n"))

    monkeypatch.setattr(run_module, "check_remote_staged", check_then_rewrite)
    try:
        with pytest.raises(DPReleaseError, match="other bytes than its worker wrote"):
            run_release(spec, key_file=tmp_path / "k.key", out_dir=bucket_uri(s3, f"rewritten-{engine}"),
                        engine=engine, **options)
    finally:
        if options:
            options["spark_session"].stop()
    assert objects(s3, f"rewritten-{engine}/releases") == []  # neither the parts copied before the failure nor the staged ones


def test_server_side_copies_wait_for_a_slow_store_with_the_same_credentials(s3, credentials):
    """The S3 filesystem a release's parts are copied with: the same options and credentials as the store's, and a
    request timeout long enough for a store that copies a large part before it answers (the SDK's 3 s default
    ended a 200-million-cell release's copy); a longer timeout in the URI is kept."""
    from dprelease.pipelines.storage import objects as objects_module
    from dprelease.pipelines.storage.uris import open_store

    store_, _ = open_store(bucket_uri(s3, "timeouts"), "--out")
    copying = objects_module._copying(store_.filesystem)
    before, after = store_.filesystem.__reduce__()[1][0], copying.__reduce__()[1][0]
    assert after.pop("request_timeout") == objects_module.COPY_REQUEST_TIMEOUT
    assert before.pop("request_timeout") < objects_module.COPY_REQUEST_TIMEOUT and before == after
    assert after["endpoint_override"] == s3 and after["access_key"] is None  # credentials: the environment's chain
    patient = pa.fs.S3FileSystem(endpoint_override=s3, scheme="http", request_timeout=2000)
    assert objects_module._copying(patient) is patient
    with store(s3).open_output_stream("timeouts/a") as handle:
        handle.write(b"part")
    copying.copy_file("timeouts/a", "timeouts/b")  # the rebuilt filesystem reaches the store
    assert objects(s3, "timeouts") == ["a", "b"]


def test_overwriting_a_release_in_a_store_leaves_no_directory_markers(s3, credentials, tmp_path):
    """--overwrite with another set of tables: the old prefix is emptied whole (a client's delete leaves empty
    directory markers, which a listing reads as odd names), so the new release verifies and can be replaced again."""
    out = bucket_uri(s3, "markers")
    first = write_case(tmp_path / "first", small_spec())
    run_release(first, key_file=tmp_path / "k1.key", out_dir=out)
    second = write_case(tmp_path / "second", small_spec(queries=small_spec()["queries"][:1]))
    for attempt in range(2):
        done = run_release(second, key_file=tmp_path / "k2.key", out_dir=out, overwrite=True)
        with downloaded(done.release_dir) as copy:
            assert verify_release(copy.path).ok
    assert not any(name.endswith("/") for name in objects(s3, "markers/releases"))


@pytest.mark.parametrize("to_store", [True, False])
def test_a_part_no_worker_reported_refuses_the_release(to_store, s3, credentials, tmp_path, monkeypatch):
    """The driver knows from the plan every file the workers must write (`expected_part_files`): a release missing
    one (it would verify: the manifest lists what was reported) is never published, in a store or a directory."""
    pytest.importorskip("apache_beam")
    from dprelease.pipelines.engines.beam import BeamEngine

    spec = write_case(tmp_path / "case", TREE_SPEC)
    release_parts = BeamEngine.release_parts

    def one_unreported(self, *args, **kwargs):
        entries, summaries = release_parts(self, *args, **kwargs)
        return entries[1:], summaries

    monkeypatch.setattr(BeamEngine, "release_parts", one_unreported)
    out = bucket_uri(s3, "unreported") if to_store else tmp_path / "out"
    with pytest.raises(DPReleaseError, match="reported 1 of the release's files missing"):
        run_release(spec, key_file=tmp_path / "k.key", out_dir=out, engine="beam")
    if to_store:
        assert objects(s3, "unreported/releases") == []
    else:
        assert not (tmp_path / "out" / "test-release").exists()


@pytest.mark.parametrize("spec_path", ["demo", "small"])
def test_the_files_a_plan_expects_are_those_the_embedded_engine_writes(spec_path, tmp_path):
    from dprelease.pipelines.layout import Layout
    from dprelease.pipelines.release import expected_part_files

    from .conftest import DEMO_SPEC

    layout = Layout(group_work=64, part_rows=64)  # many parts per table
    if spec_path == "demo":
        from dprelease.pipelines.commands import demo_data

        data, _ = demo_data(2_000, tmp_path / "data", seed=3)
        spec = DEMO_SPEC
        done = run_release(spec, input_path=str(data), out_dir=tmp_path / "out", key_file=tmp_path / "k.key",
                           layout=layout)
    else:
        spec = write_case(tmp_path / "case", small_spec())
        done = run_release(spec, out_dir=tmp_path / "out", key_file=tmp_path / "k.key", layout=layout)
    manifest = json.loads((done.release_dir / "manifest.json").read_text())
    written = {f["path"] for f in manifest["files"] if not f["path"].startswith("domains/")}
    assert written == expected_part_files(build_plan(*load_spec(spec)), layout)


def test_a_store_that_cannot_be_listed_removes_nothing_and_says_where(caplog):
    """The sweep of killed runs' prefixes against an S3 endpoint nobody answers (a closed port of 127.0.0.1):
    nothing is removed, and a warning names the location (no secret) and the kind of error."""
    import logging
    import socket

    import pyarrow.fs as pafs

    from dprelease.pipelines.storage import remove_stale_remote
    from dprelease.pipelines.storage.uris import Store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    filesystem = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", access_key="key-id",
                                   secret_key="not-shown", region="us-east-1", connect_timeout=1, request_timeout=1,
                                   retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    with caplog.at_level(logging.WARNING, logger="dprelease"):
        removed = remove_stale_remote(Store(filesystem, "s3://"), "bucket/releases", ".r.staging+",
                                      lambda host, token: False)
    assert removed == []
    assert "could not list s3://bucket/releases" in caplog.text and "nothing removed" in caplog.text
    assert "not-shown" not in caplog.text

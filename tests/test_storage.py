"""Inputs by URI through pyarrow's filesystems, against a real S3-compatible server (moto's, started on
127.0.0.1 by the test; pyarrow's S3 client speaks HTTP to it): the release equals the one from the same files
on local disk, markers are skipped, credentials in a URI and missing objects are exit-2 errors."""
from __future__ import annotations


import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import dprelease
from dprelease.pipelines.run import run_release

from .test_api import persons
from .conftest import small_spec, write_case

moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port of 127.0.0.1 (port 0: the system picks it when the server binds, so two test
    processes never race for one); yields its endpoint (host:port)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield "127.0.0.1:%d" % server.get_host_and_port()[1]
    server.stop()


@pytest.fixture
def credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def upload(endpoint: str, bucket: str, files: dict[str, bytes]) -> None:
    store = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
    store.create_dir(bucket)
    for name, data in files.items():
        with store.open_output_stream(f"{bucket}/{name}") as out:
            out.write(data)


def parquet_bytes(frame) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), sink)
    return sink.getvalue().to_pybytes()


def test_a_release_from_s3_equals_the_release_from_the_same_local_files(s3, credentials, tmp_path, monkeypatch):
    """The same records, read from S3 or from disk, give the same release under one binding of the key (the
    fingerprints differ by design: S3's is of ETags; fixed here so that the noise is the same)."""
    from dprelease.pipelines.source import InputSource

    monkeypatch.setattr(InputSource, "fingerprint", lambda self, key: "same-input")
    frame = persons(500)
    parts = {"part-0.parquet": parquet_bytes(frame.iloc[:250]), "part-1.parquet": parquet_bytes(frame.iloc[250:])}
    upload(s3, "census", {f"persons/{name}": data for name, data in parts.items()} | {"persons/_SUCCESS": b""})
    local = tmp_path / "persons"
    local.mkdir()
    for name, data in parts.items():
        (local / name).write_bytes(data)
    spec = write_case(tmp_path / "case", small_spec())
    key = tmp_path / "k.key"
    on_disk = run_release(spec, input_path=str(local), out_dir=tmp_path / "disk", key_file=key)
    uri = f"s3://census/persons/?endpoint_override={s3}&scheme=http"
    from_s3 = run_release(spec, input_path=uri, out_dir=tmp_path / "s3", key_file=key)
    for folder in ("tables", "measurements"):
        for path in sorted((on_disk.release_dir / folder).iterdir()):
            assert path.read_bytes() == (from_s3.release_dir / folder / path.name).read_bytes(), path.name
    assert dprelease.ReleaseResult.open(from_s3.release_dir).verify().ok


def test_the_python_api_reads_a_uri(s3, credentials, tmp_path):
    upload(s3, "api", {"persons.parquet": parquet_bytes(persons(300))})
    write_case(tmp_path, small_spec())
    result = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(
        f"s3://api/persons.parquet?endpoint_override={s3}&scheme=http", ledger=None)
    assert int(result.table("pop.nation")["count"].iloc[0]) > 0


@pytest.mark.parametrize("uri", [
    "s3://census/persons/?endpoint_override={s3}&scheme=http&secret_key=abc&access_key=def",
    "s3://census/persons/?endpoint_override={s3}&scheme=http&session_token=xyz",
    "s3://census/persons/?endpoint_override={s3}&scheme=http&Secret_Key=abc",
    "s3://key:abc@census/persons/",
    "hdfs://namenode:8020/persons?hdfs_token=abc",
    "abfs://acct.blob.core.windows.net/container/x?client_id=C&tenant_id=T&client_secret=abc",
])
def test_credentials_in_a_uri_are_refused_before_anything_is_read(s3, credentials, tmp_path, uri):
    """Only the query options each store reads as connection settings are allowed (an allow-list); other stores are
    refused: anything else could be a credential, and the URI is published."""
    spec = write_case(tmp_path, small_spec())
    with pytest.raises(dprelease.SpecError) as info:
        run_release(spec, input_path=uri.format(s3=s3))
    assert info.value.exit_code == 2 and "abc" not in str(info.value) and "xyz" not in str(info.value)


def test_a_file_uri_is_a_local_path_with_its_link_checks(tmp_path):
    """file:// goes through the local reader: an alias link is refused as for a plain path."""
    spec = write_case(tmp_path / "case", small_spec())
    data = tmp_path / "persons"
    data.mkdir()
    (data / "part-0.parquet").write_bytes(parquet_bytes(persons(100)))
    (data / "alias.parquet").symlink_to(data / "part-0.parquet")
    with pytest.raises(dprelease.SpecError, match="alias"):
        run_release(spec, input_path=f"file://{data}")
    (data / "alias.parquet").unlink()
    assert run_release(spec, input_path=f"file://{data}", out_dir=tmp_path / "out").release_dir.exists()


def test_an_input_changed_during_the_run_publishes_nothing(s3, credentials, tmp_path, monkeypatch):
    """The key is bound to the bytes fingerprinted first; an object rewritten before the engine reads it would get
    the same noise over other data: the run aborts before anything is charged or published."""
    from dprelease.pipelines import run as run_module

    upload(s3, "moving", {"persons.parquet": parquet_bytes(persons(300))})
    spec = write_case(tmp_path, small_spec())
    original = run_module.bind_release_key

    def rewrite_after_fingerprint(key, plan, source):
        bound = original(key, plan, source)
        upload(s3, "moving", {"persons.parquet": parquet_bytes(persons(299))})
        return bound

    monkeypatch.setattr(run_module, "bind_release_key", rewrite_after_fingerprint)
    with pytest.raises(dprelease.DPReleaseError, match="bytes changed after the release key was bound"):
        run_release(spec, input_path=f"s3://moving/persons.parquet?endpoint_override={s3}&scheme=http",
                    out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "test-release").exists()


def test_an_object_that_is_also_a_prefix_is_refused(s3, credentials, tmp_path):
    upload(s3, "ambiguous", {"p": parquet_bytes(persons(10)), "p/part-0.parquet": parquet_bytes(persons(10))})
    spec = write_case(tmp_path, small_spec())
    with pytest.raises(dprelease.SpecError, match="prefix"):
        run_release(spec, input_path=f"s3://ambiguous/p?endpoint_override={s3}&scheme=http")


def test_a_missing_object_is_a_spec_error(s3, credentials, tmp_path):
    upload(s3, "empty", {})
    spec = write_case(tmp_path, small_spec())
    with pytest.raises(dprelease.SpecError, match="no such file or directory"):
        run_release(spec, input_path=f"s3://empty/nothing-here/?endpoint_override={s3}&scheme=http")


def s3_source(s3, bucket, tmp_path):
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.source import open_input
    from dprelease.pipelines.spec import load_spec

    spec, spec_dir = load_spec(write_case(tmp_path, small_spec()))
    return open_input(build_plan(spec, spec_dir), spec_dir, f"s3://{bucket}/?endpoint_override={s3}&scheme=http")


COLLIDING = (bytes.fromhex(
    "d131dd02c5e6eec4693d9a0698aff95c2fcab58712467eab4004583eb8fb7f8955ad340609f4b30283e488832571415a085125e8f7cdc9"
    "9fd91dbdf280373c5bd8823e3156348f5bae6dacd436c919c6dd53e2b487da03fd02396306d248cda0e99f33420f577ee8ce54b67080a8"
    "0d1ec69821bcb6a8839396f9652b6ff72a70"), bytes.fromhex(
    "d131dd02c5e6eec4693d9a0698aff95c2fcab50712467eab4004583eb8fb7f8955ad340609f4b30283e4888325f1415a085125e8f7cdc9"
    "9fd91dbd7280373c5bd8823e3156348f5bae6dacd436c919c6dd53e23487da03fd02396306d248cda0e99f33420f577ee8ce54b6708028"
    "0d1ec69821bcb6a8839396f965ab6ff72a70"))
"""Wang's MD5 collision pair: two 128-byte blocks with one MD5, hence (uploaded alike) one S3 ETag."""


def test_objects_sharing_an_etag_get_different_fingerprints(s3, credentials):
    """An ETag is an MD5: two different inputs can share one (a found review: a free rerun on other data with the
    same noise). The fingerprint reads the bytes, so it tells them apart."""
    from dprelease.pipelines.storage import fingerprint_files, open_store

    assert COLLIDING[0] != COLLIDING[1]
    upload(s3, "collide", {"a/part-0.csv": COLLIDING[0], "b/part-0.csv": COLLIDING[1]})
    store, _ = open_store(f"s3://collide/?endpoint_override={s3}&scheme=http", "input.path")
    infos = store.filesystem.get_file_info(["collide/a/part-0.csv", "collide/b/part-0.csv"])
    assert infos[0].size == infos[1].size
    fingerprints = {fingerprint_files([(f"collide/{side}/part-0.csv", side)], store.filesystem, b"k" * 32)[0]
                    for side in ("a", "b")}
    assert len(fingerprints) == 2


def test_an_object_rewritten_with_the_same_size_after_the_fingerprint_is_never_parsed(s3, credentials, tmp_path):
    """S3 keeps modification times to the second and an ETag is an MD5: only the bytes tell. A worker parses a
    private copy whose SHA-256 is the one taken with the fingerprint, or nothing."""
    import csv
    import io

    from dprelease.pipelines.storage import InputChanged

    def table(value: str) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["pid", "geo", "age", "sex"])
        writer.writerows([[i, "01001000100", 30, value] for i in range(50)])
        return out.getvalue().encode()

    upload(s3, "sametime", {"persons.csv": table("F")})
    source = s3_source(s3, "sametime", tmp_path / "b")
    from dprelease.transforms.csprng import ReleaseKey

    source.fingerprint(ReleaseKey.generate())
    path = source.files()[0]
    assert sum(batch.num_rows for batch in source.batches(path)) == 50
    upload(s3, "sametime", {"persons.csv": table("M")})  # same size, within the same second
    with pytest.raises(InputChanged, match="persons.csv"):
        list(source.batches(path))
    reader = source.reader()  # what a Spark executor or Beam worker gets: the same check
    with pytest.raises(InputChanged):
        list(reader.batches(path))


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_the_beam_engine_reads_a_uri_and_publishes_the_embedded_release(s3, credentials, tmp_path, fmt):
    """Beam's workers reopen the store from the input URI (credentials from their environment) and read the
    files through pyarrow: the same records, the same key, the same release as the embedded engine."""
    pytest.importorskip("apache_beam")
    frame = persons(400)
    if fmt == "csv":
        data = {"part-0.csv": frame.iloc[:200].to_csv(index=False).encode(),
                "part-1.csv": frame.iloc[200:].to_csv(index=False).encode()}
    else:
        data = {"part-0.parquet": parquet_bytes(frame.iloc[:200]), "part-1.parquet": parquet_bytes(frame.iloc[200:])}
    upload(s3, f"beam-{fmt}", {f"persons/{name}": body for name, body in data.items()})
    spec = write_case(tmp_path / "case", small_spec())
    uri = f"s3://beam-{fmt}/persons/?endpoint_override={s3}&scheme=http"
    key = tmp_path / "k.key"
    embedded = run_release(spec, input_path=uri, out_dir=tmp_path / "embedded", key_file=key)
    beam = run_release(spec, input_path=uri, out_dir=tmp_path / "beam", key_file=key, engine="beam", workers=2)
    for folder in ("tables", "measurements"):
        for path in sorted((embedded.release_dir / folder).iterdir()):
            assert path.read_bytes() == (beam.release_dir / folder / path.name).read_bytes(), path.name

"""Releases published to an object store (a real S3-compatible server on 127.0.0.1, as in test_storage): the
manifest is uploaded last, so an interrupted upload leaves no release, is charged, and republishes free; verify,
report and the Python API read a release by URI; tampering in the store is a mismatch."""
from __future__ import annotations

import subprocess
import sys
import threading
from collections import namedtuple
from fractions import Fraction

import pyarrow.fs as pafs
import pytest

import dprelease
from dprelease.accounting.errors import PublishError, SpecError
from dprelease.accounting.ledger import COMMITTED, open_ledger, set_budget
from dprelease.pipelines.storage import objects as remote_module
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import published_manifest_sha256

from .conftest import small_spec, write_case
from .test_api import persons
from .test_key_reuse import statuses
from .test_storage import credentials, s3  # noqa: F401 - fixtures

CLI = [sys.executable, "-m", "dprelease.pipelines.cli"]


def store(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)


def bucket_uri(endpoint: str, bucket: str, path: str = "releases") -> str:
    store(endpoint).create_dir(bucket)
    return f"s3://{bucket}/{path}?endpoint_override={endpoint}&scheme=http"


def objects(endpoint: str, prefix: str) -> list[str]:
    infos = store(endpoint).get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    return sorted(i.path[len(prefix) + 1:] for i in infos if i.type == pafs.FileType.File)


def test_the_cli_publishes_to_s3_and_verifies_and_reports_from_it(s3, credentials, tmp_path, monkeypatch):
    spec = write_case(tmp_path / "case", small_spec())
    ledger = tmp_path / "ledger.sqlite"
    subprocess.run([*CLI, "ledger", "set-budget", "test-data", "--epsilon", "5", "--ledger", str(ledger)],
                   check=True, capture_output=True)
    out = bucket_uri(s3, "published")
    done = subprocess.run([*CLI, "run", str(spec), "--out", out, "--ledger", str(ledger)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "s3://published/releases/test-release" in done.stdout
    names = objects(s3, "published/releases/test-release")
    assert "manifest.json" in names and "tables/pop.nation.parquet" in names
    release = f"s3://published/releases/test-release?endpoint_override={s3}&scheme=http"
    checked = subprocess.run([*CLI, "verify", release, "--ledger", str(ledger)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "OK" in checked.stdout
    monkeypatch.chdir(tmp_path)
    reported = subprocess.run([*CLI, "report", release], capture_output=True, text=True)
    assert reported.returncode == 0, reported.stderr
    assert "verify: passed" in (tmp_path / "test-release.report.html").read_text(encoding="utf-8")
    again = subprocess.run([*CLI, "run", str(spec), "--out", out, "--no-ledger"], capture_output=True, text=True)
    assert again.returncode == 2 and "already holds a release" in again.stderr
    with store(s3).open_output_stream("published/releases/test-release/tables/pop.nation.csv") as handle:
        handle.write(b'"nation","count"\n"US",999999\n')
    tampered = subprocess.run([*CLI, "verify", release], capture_output=True, text=True)
    assert tampered.returncode == 1 and "MISMATCH" in tampered.stderr


def test_an_interrupted_upload_leaves_no_release_stays_charged_and_republishes_free(s3, credentials, tmp_path,
                                                                                   monkeypatch):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    spec = write_case(tmp_path / "case", small_spec())
    out = bucket_uri(s3, "interrupted")
    copied = []
    real_upload = remote_module._upload_file

    def fail_on_the_third(local, filesystem, path):
        if len(copied) == 2:
            raise OSError("connection reset")
        copied.append(path)
        return real_upload(local, filesystem, path)

    with monkeypatch.context() as patched:  # undone at its end (the credentials stay)
        patched.setattr(remote_module, "_upload_file", fail_on_the_third)
        with pytest.raises(PublishError, match="charged in the ledger but not published"):
            run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=out)
        assert objects(s3, "interrupted/releases/test-release") == []  # what it uploaded is removed
        copied.clear()
        patched.setattr(remote_module, "_remove_unpublished", lambda *args: None)  # the store went away
        with pytest.raises(PublishError, match="could not remove what it copied"):
            run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=out)
    left = objects(s3, "interrupted/releases/test-release")
    assert len(left) == 2 and "manifest.json" not in left  # the manifest goes last: no release
    assert statuses(book) == [COMMITTED]
    with pytest.raises(dprelease.DPReleaseError, match="not a published release"):
        dprelease.ReleaseResult.open(f"s3://interrupted/releases/test-release?endpoint_override={s3}&scheme=http")
    with pytest.raises(SpecError, match="no manifest"):  # leftovers are never removed without --overwrite
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=out)
    again = run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=out, overwrite=True)
    result = dprelease.ReleaseResult.open(again.release_dir)
    assert result.manifest["ledger"]["rerun_of_committed_release"] is True
    assert result.manifest["ledger"]["charged_by_this_run"] == "0"
    assert result.verify(ledger=book).ok and statuses(book) == [COMMITTED]


def _local_release(directory, tag: str):
    directory.mkdir()
    (directory / "tables").mkdir()
    (directory / "tables" / "t.csv").write_text(tag)
    (directory / "manifest.json").write_text('{"run": "%s"}' % tag)
    return directory


@pytest.mark.parametrize("other", ["inner", "same"])
def test_a_failed_upload_removes_only_what_it_wrote(other, s3, credentials, tmp_path, monkeypatch):
    """While run A uploads, run B publishes a release inside A's prefix ("inner", which A's check could not see:
    A's manifest goes last) or the same release ("same", a retry); A's next upload then fails. A removes the
    objects it wrote, by name (and their empty directory markers), never B's release; with B's manifest in A's
    own prefix it removes nothing, since B's parts bear the names A wrote."""
    bucket_uri(s3, f"raced-{other}")
    uri = f"s3://raced-{other}/out/r?endpoint_override={s3}&scheme=http"
    a, b = (remote_module.open_release(u, "--out") for u in (uri, uri.replace("/r?", "/r/inner?") if other == "inner"
                                                               else uri))
    real_upload = remote_module._upload_file
    calls = []

    def racing(local, filesystem, path):
        calls.append(path)
        if len(calls) > 1:
            raise OSError("connection reset")
        real_upload(local, filesystem, path)
        with monkeypatch.context() as patched:
            patched.setattr(remote_module, "_upload_file", real_upload)
            remote_module.upload_release(_local_release(tmp_path / "b", "B"), b, other == "same")

    monkeypatch.setattr(remote_module, "_upload_file", racing)
    with pytest.raises(OSError, match="connection reset"):
        remote_module.upload_release(_local_release(tmp_path / "a", "A"), a, False)
    assert b.exists()
    if other == "inner":
        assert objects(s3, "raced-inner/out/r") == ["inner/manifest.json", "inner/tables/t.csv"]
    else:
        assert objects(s3, "raced-same/out/r") == ["manifest.json", "tables/t.csv"]
    assert remote_module.list_prefix(a.store, a.path).odd == []  # no empty marker of A's left for a re-run


def test_a_failed_upload_leaves_no_directory_marker_a_re_run_would_refuse(s3, credentials, tmp_path, monkeypatch):
    bucket_uri(s3, "markers-left")
    release = remote_module.open_release(f"s3://markers-left/out/r?endpoint_override={s3}&scheme=http", "--out")
    real_upload = remote_module._upload_file
    monkeypatch.setattr(remote_module, "_upload_file", lambda local, filesystem, path: (
        real_upload(local, filesystem, path) if path.endswith(".csv") else (_ for _ in ()).throw(OSError("reset"))))
    with pytest.raises(OSError, match="reset"):
        remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False)
    assert objects(s3, "markers-left/out/r") == []
    assert remote_module.list_prefix(release.store, release.path).odd == []


def _staged(endpoint: str, bucket: str, count: int) -> list[tuple[str, str, str]]:
    """`count` parts staged in the store as a distributed engine's workers stage them: (path, name, SHA-256)."""
    import hashlib

    parts = []
    for i in range(count):
        data = f"part {i}".encode()
        with store(endpoint).open_output_stream(f"{bucket}/staging/p{i}") as out:
            out.write(data)
        parts.append((f"{bucket}/staging/p{i}", f"tables/p{i}.csv", hashlib.sha256(data).hexdigest()))
    return parts


class _StuckCopies:
    """A store whose copy of `stuck` never answers (until `release` is set) and whose copy of `failing` fails;
    every other copy is the store's own."""

    def __init__(self, filesystem, stuck: str, failing: str | None = None, then=None):
        self.filesystem, self.stuck, self.failing, self.then = filesystem, stuck, failing, then
        self.release, self.started, self.ended = threading.Event(), threading.Event(), threading.Event()

    def copy_file(self, source: str, target: str) -> None:
        if source.endswith(self.stuck):
            self.started.set()
            self.release.wait(60)
            self.ended.set()
            raise OSError("the store never answered")
        self.started.wait(60)  # the stuck copy is under way before any other ends
        if self.failing and source.endswith(self.failing):
            if self.then:
                self.then()
            raise OSError("connection reset")
        self.filesystem.copy_file(source, target)


@pytest.mark.parametrize("stop", ["failure", "signal"])
def test_a_copy_that_never_ends_does_not_hold_a_stopping_upload(stop, s3, credentials, tmp_path, monkeypatch):
    """One staged part's copy never answers (a black-holed store: with its timeout and the SDK's retries it could
    hold the run for most of an hour); another copy fails, or the run is stopped by a signal. The upload raises
    after COPY_DRAIN_SECONDS, with the stuck copy still under way (its threads are daemons, never joined), and
    removes what the others copied."""
    import os
    import signal

    bucket_uri(s3, f"stuck-{stop}")
    release = remote_module.open_release(f"s3://stuck-{stop}/out/r?endpoint_override={s3}&scheme=http", "--out")
    parts = _staged(s3, f"stuck-{stop}", 40)

    class Stopped(Exception):
        pass

    def stopped(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGUSR1, stopped)
    kill = (lambda: os.kill(os.getpid(), signal.SIGUSR1)) if stop == "signal" else None
    stuck = _StuckCopies(release.store.filesystem, "p0", failing="p3", then=kill)
    monkeypatch.setattr(remote_module, "_copying", lambda filesystem: stuck)
    monkeypatch.setattr(remote_module, "COPY_DRAIN_SECONDS", 0.5)
    try:
        with pytest.raises(Stopped if stop == "signal" else OSError):
            remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts)
        assert not stuck.ended.is_set()  # raised while the stuck copy was still under way
        assert any(t.name.startswith("dprelease-copy-") and t.daemon for t in threading.enumerate())
        assert objects(s3, f"stuck-{stop}/out/r") == []  # what the other copies wrote is removed
        assert len(objects(s3, f"stuck-{stop}/staging")) == 40  # staging is the caller's to remove
    finally:
        stuck.release.set()
        signal.signal(signal.SIGUSR1, previous)


def test_a_second_interruption_while_copies_drain_still_removes_what_was_written(s3, credentials, tmp_path,
                                                                                  monkeypatch):
    """A second signal (a second Ctrl-C) while the copies under way drain: the clean-up still runs."""
    import os
    import signal

    bucket_uri(s3, "twice")
    release = remote_module.open_release(f"s3://twice/out/r?endpoint_override={s3}&scheme=http", "--out")
    parts = _staged(s3, "twice", 12)

    class Stopped(Exception):
        pass

    def stopped(signum, frame):
        raise Stopped

    def signal_twice():
        os.kill(os.getpid(), signal.SIGUSR1)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()  # during the drain

    previous = signal.signal(signal.SIGUSR1, stopped)
    stuck = _StuckCopies(release.store.filesystem, "p0", failing="p3", then=signal_twice)
    monkeypatch.setattr(remote_module, "_copying", lambda filesystem: stuck)
    monkeypatch.setattr(remote_module, "COPY_DRAIN_SECONDS", 3.0)
    try:
        with pytest.raises(Stopped):
            remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts)
        assert objects(s3, "twice/out/r") == []
    finally:
        stuck.release.set()
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("report", ["duplicate", "unasked", "not_copied"])
def test_the_digests_an_engine_reports_must_match_what_lies_in_the_release(report, s3, credentials, tmp_path, caplog):
    """An engine's copier reports each part's digest once, for the parts asked for only, and each part must then
    lie under the release's prefix with its staged size: a digest alone never stands for an object."""
    bucket_uri(s3, f"reported-{report}")
    release = remote_module.open_release(f"s3://reported-{report}/out/r?endpoint_override={s3}&scheme=http", "--out")
    parts = _staged(s3, f"reported-{report}", 3)

    def copier(uri, path, asked):
        digests = remote_module.copy_checked(uri, path, asked[1:] if report == "not_copied" else asked)
        if report == "not_copied":
            return digests + [(asked[0][1], asked[0][2])]
        return digests + ([digests[0]] if report == "duplicate" else [("tables/other.csv", "0" * 64)])

    with pytest.raises(dprelease.DPReleaseError, match="some twice or for parts never asked for"
                       if report != "not_copied" else "not in .* with its staged size"):
        remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts, copier)
    assert objects(s3, f"reported-{report}/out/r") == []
    assert "may still land" not in caplog.text  # the workers had finished: nothing of theirs is in flight


def test_a_copy_by_the_workers_that_fails_warns_that_what_they_began_may_still_land(s3, credentials, tmp_path,
                                                                                   caplog):
    """An engine's copy that fails part-way: what the store had already received may land after the clean-up, and
    the warning says so (it is not given when the workers had finished and a later step failed: above)."""
    bucket_uri(s3, "halfway")
    release = remote_module.open_release(f"s3://halfway/out/r?endpoint_override={s3}&scheme=http", "--out")
    parts = _staged(s3, "halfway", 2)

    def copier(uri, path, asked):
        remote_module.copy_checked(uri, path, asked[:1])
        raise dprelease.DPReleaseError("a worker failed")

    with pytest.raises(dprelease.DPReleaseError, match="a worker failed"):
        remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts, copier)
    assert objects(s3, "halfway/out/r") == []
    assert "may still land" in caplog.text


def test_workers_copy_nothing_where_the_release_uri_opens_at_another_path(s3, credentials):
    """A path whose URI does not read back the same ('%41' decoded twice): the workers refuse to copy."""
    bucket_uri(s3, "roundtrip")
    parts = _staged(s3, "roundtrip", 1)
    with pytest.raises(dprelease.DPReleaseError, match="names another path in the workers"):
        remote_module.copy_checked(f"s3://roundtrip/outA/r?endpoint_override={s3}&scheme=http", "roundtrip/out%41/r",
                                   parts)
    assert objects(s3, "roundtrip") == ["staging/p0"]


@pytest.mark.parametrize("name", ["out%41", "out#x", "out?x", "out x", "café", "a+b"])
def test_a_release_path_reopens_where_it_was_named_in_the_workers(name, s3, credentials, tmp_path):
    """A store path's URI opens at the same path again (it is percent-quoted), so the workers copy a release's parts
    under the driver's prefix whatever its name holds ('%41' once copied into 'outA/', '#' lost the options)."""
    from urllib.parse import quote

    from dprelease.pipelines.storage.uris import open_store

    bucket_uri(s3, "names")
    root, _ = open_store(f"s3://names?endpoint_override={s3}&scheme=http", "--out")
    assert open_store(root.uri(f"names/{name}/r") + f"?endpoint_override={s3}&scheme=http", "--out")[1] == \
        f"names/{name}/r"
    release = remote_module.open_release(f"s3://names/{quote(name)}/r?endpoint_override={s3}&scheme=http", "--out")
    assert release.path == f"names/{name}/r"
    parts = _staged(s3, "names", 2)
    remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts,
                                 remote_module.copy_checked)
    assert objects(s3, f"names/{name}/r") == ["manifest.json", "tables/p0.csv", "tables/p1.csv", "tables/t.csv"]


def test_a_copy_thread_that_cannot_start_stops_the_upload_at_once(s3, credentials, tmp_path, monkeypatch, caplog):
    """A thread that could not start (or a signal while it started) is not counted as a copy under way: the
    upload raises without waiting for it and says nothing of copies still running."""
    bucket_uri(s3, "nothread")
    release = remote_module.open_release(f"s3://nothread/out/r?endpoint_override={s3}&scheme=http", "--out")
    parts = _staged(s3, "nothread", 12)
    real_start, started = threading.Thread.start, []

    def third_fails(thread):
        if thread.name.startswith("dprelease-copy-"):
            started.append(thread.name)
            if len(started) == 3:
                raise RuntimeError("can't start new thread")
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", third_fails)
    with pytest.raises(RuntimeError, match="can't start"):
        remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts)
    assert "still under way" not in caplog.text
    assert objects(s3, "nothread/out/r") == []


def test_staged_parts_are_copied_and_checked_before_the_manifest(s3, credentials, tmp_path):
    bucket_uri(s3, "copied")
    release = remote_module.open_release(f"s3://copied/out/r?endpoint_override={s3}&scheme=http", "--out")
    parts = _staged(s3, "copied", 20)
    remote_module.upload_release(_local_release(tmp_path / "a", "A"), release, False, parts)
    assert objects(s3, "copied/out/r") == sorted(["manifest.json", "tables/t.csv",
                                                  *(f"tables/p{i}.csv" for i in range(20))])
    changed = [(path, name, "0" * 64 if name.endswith("p7.csv") else digest) for path, name, digest in parts]
    again = remote_module.open_release(f"s3://copied/out/r2?endpoint_override={s3}&scheme=http", "--out")
    with pytest.raises(dprelease.DPReleaseError, match="p7.csv: copied .* with other bytes"):
        remote_module.upload_release(_local_release(tmp_path / "b", "B"), again, False, changed)
    assert objects(s3, "copied/out/r2") == []


def test_the_python_api_publishes_to_s3_and_reads_the_tables_back(s3, credentials, tmp_path):
    """The release's local copy lives in a run temporary directory named after the process, so a run removes
    the ones (and the Beam engine's result directories) that killed runs on this host left."""
    import tempfile
    from pathlib import Path

    from dprelease.pipelines.housekeeping import RUN_TEMPORARY_PREFIXES, host_identity

    dead = [Path(tempfile.gettempdir()) / f"{prefix}4194303.1@{host_identity()}@x1"
            for prefix in RUN_TEMPORARY_PREFIXES]
    for directory in dead:
        directory.mkdir()
        (directory / "00000-000000000000.npy").write_bytes(b"noisy values of a run that was killed")
    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    result = release.run(persons(400), ledger=None, out_dir=bucket_uri(s3, "api-out"))
    assert result.location.startswith("s3://api-out/releases/test-release")
    assert int(result.table("pop.nation")["count"].iloc[0]) > 0 and result.verify().ok
    copy = result.directory
    assert copy.exists() and not any(directory.exists() for directory in dead)
    del result
    import gc

    gc.collect()
    assert not copy.exists()  # the temporary copy goes with the object


def test_reconcile_finds_a_release_published_in_the_store(s3, credentials, tmp_path):
    spec = write_case(tmp_path / "case", small_spec())
    published = run_release(spec, out_dir=bucket_uri(s3, "reconciled"), key_file=tmp_path / "k.key")
    manifest = dprelease.ReleaseResult.open(published.release_dir).manifest
    Row = namedtuple("Row", "release_dir dataset_id release_id key_id spec_sha256")
    row = Row(published.release_dir, "test-data", "test-release", manifest["key_id"], manifest["spec_sha256"])
    assert published_manifest_sha256(row) is not None
    assert published_manifest_sha256(row._replace(key_id="other")) is None
    assert published_manifest_sha256(row._replace(release_dir=published.release_dir.replace(
        "test-release", "never-published"))) is None


def test_a_downloaded_object_is_read_no_further_than_its_manifest_says(s3, credentials, tmp_path):
    spec = write_case(tmp_path / "case", small_spec())
    published = run_release(spec, out_dir=bucket_uri(s3, "bounded"), key_file=tmp_path / "k.key")
    manifest = dprelease.ReleaseResult.open(published.release_dir).manifest
    listed = {f["path"]: f["bytes"] for f in manifest["files"]}
    with store(s3).open_output_stream("bounded/releases/test-release/tables/pop.nation.csv") as handle:
        handle.write(b"x" * (1 << 22))
    with remote_module.downloaded(published.release_dir) as copy:
        assert (copy.path / "tables" / "pop.nation.csv").stat().st_size == listed["tables/pop.nation.csv"] + 1
        assert not dprelease.pipelines.verify.verify_release(copy.path).ok


def test_objects_under_the_release_prefix_are_never_removed_without_overwrite(s3, credentials, tmp_path):
    """A prefix that holds anything (here someone's notes) is refused, as a local run refuses an existing
    directory; nothing is deleted (found by review: the leftovers rule deleted other objects)."""
    out = bucket_uri(s3, "shared-prefix")
    with store(s3).open_output_stream("shared-prefix/releases/test-release/notes.txt") as handle:
        handle.write(b"someone else's")
    spec = write_case(tmp_path / "case", small_spec())
    with pytest.raises(SpecError, match="already holds 1 object"):
        run_release(spec, out_dir=out, key_file=tmp_path / "k.key")
    assert objects(s3, "shared-prefix/releases/test-release") == ["notes.txt"]


def test_verify_by_uri_reports_odd_object_names_as_mismatches_not_tracebacks(s3, credentials, tmp_path):
    spec = write_case(tmp_path / "case", small_spec())
    published = run_release(spec, out_dir=bucket_uri(s3, "odd"), key_file=tmp_path / "k.key")
    import boto3  # pyarrow refuses to write such a name; another client can

    boto3.client("s3", endpoint_url=f"http://{s3}").put_object(
        Bucket="odd", Key="releases/test-release/tables//pop.nation.csv", Body=b"x")
    with store(s3).open_output_stream("odd/releases/test-release/extra.txt") as handle:
        handle.write(b"x")
    done = subprocess.run([*CLI, "verify", published.release_dir], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "extra.txt" in done.stderr


def test_a_published_release_whose_read_back_fails_says_it_is_published(s3, credentials, tmp_path, monkeypatch):
    """After the upload the run is published and charged: a failure to read it back is never a failed run to
    repeat (found by review); the coding check runs on the local copy before it is removed."""
    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    monkeypatch.setattr(remote_module, "_read_bounded", lambda *a: (_ for _ in ()).throw(OSError("denied")))
    with pytest.raises(PublishError, match="published to s3://.* and charged, but reading it back failed"):
        release.run(persons(300), ledger=None, out_dir=bucket_uri(s3, "write-only"))
    assert "manifest.json" in objects(s3, "write-only/releases/test-release")

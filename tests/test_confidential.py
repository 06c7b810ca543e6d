"""Nothing confidential leaves: one record never decides whether a run aborts, no value reaches the
console, schema problems of every input file are public exit-2 errors, spill and staging files are
private and never outlive the run (SIGTERM included), and a later run removes what a SIGKILL left."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dprelease.accounting.errors import InputSchemaError
from dprelease.accounting.ledger import ABORTED, history, open_ledger, set_budget
from dprelease.pipelines.engines import embedded as embedded_module
from dprelease.pipelines.housekeeping import host_identity
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release

from .conftest import GEO_LEAVES

SECRET_INT = 2**60 + 12345  # a value that must never be printed
SECRET_TEXT = b"\xffSECRET\xfe"


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, env=env)


def base_rows() -> dict:
    return {"pid": [1, 2, 3, 4], "geo": [GEO_LEAVES[0], GEO_LEAVES[3], GEO_LEAVES[5], GEO_LEAVES[1]],
            "age": [10, 40, 70, 30], "sex": ["F", "M", "F", "M"]}


def assert_public(result: subprocess.CompletedProcess, *secrets: str) -> None:
    text = result.stdout + result.stderr
    assert "Traceback" not in text
    for secret in secrets:
        assert secret not in text


# 6. Record-level problems go through the column's policy ---------------------------------------------------------

def test_an_integer_beyond_2_53_is_an_invalid_value_not_an_abort(case, tmp_path):
    data = base_rows() | {"age": pa.array([10, SECRET_INT, 70, 30], pa.int64())}
    ran = cli("run", case(rows=data), "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 0, ran.stderr
    assert_public(ran, str(SECRET_INT))
    assert verify_release(tmp_path / "out" / "test-release").ok


def test_a_uint64_unit_id_at_or_above_2_63_is_a_unit_like_any_other(case, tmp_path):
    data = base_rows() | {"pid": pa.array([1, 2**63, 2**64 - 1, 2**63], pa.uint64())}
    ran = cli("run", case(rows=data, contribution={"max_records_per_unit": 1}), "--no-ledger",
              "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 0, ran.stderr
    assert_public(ran, str(2**63))


def test_invalid_utf8_in_a_parquet_string_field_is_an_invalid_value(case, tmp_path):
    spec = case()
    geo = pa.array([GEO_LEAVES[0].encode(), SECRET_TEXT, GEO_LEAVES[5].encode(), GEO_LEAVES[1].encode()], pa.binary())
    sex = pa.array([b"F", b"M", SECRET_TEXT, b"M"], pa.binary())
    table = pa.table({"pid": [1, 2, 3, 4], "geo": geo.cast(pa.string(), safe=False), "age": [10, 40, 70, 30],
                      "sex": sex.cast(pa.string(), safe=False)})
    pq.write_table(table, spec.parent / "input.parquet")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 0, ran.stderr
    assert_public(ran, "SECRET")


def test_invalid_utf8_in_a_csv_field_is_an_invalid_value_with_validation_too(case, tmp_path):
    spec = case(input={"path": "input.csv"})
    lines = [b"pid,geo,age,sex", f"1,{GEO_LEAVES[0]},10,F".encode(), b"2," + SECRET_TEXT + b",40,M",
             f"3,{GEO_LEAVES[5]},70,".encode() + SECRET_TEXT, b"4" + SECRET_TEXT + f",{GEO_LEAVES[1]},30,M".encode()]
    (spec.parent / "input.csv").write_bytes(b"\n".join(lines) + b"\n")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out",
              "--internal-dir", tmp_path / "internal")
    assert ran.returncode == 0, ran.stderr
    assert_public(ran, "SECRET")


def test_a_struct_or_list_column_is_a_schema_error_naming_file_and_column(case, tmp_path):
    data = base_rows() | {"sex": pa.array([{"v": "F"}, {"v": "M"}, {"v": "F"}, {"v": "SECRETVALUE"}])}
    ran = cli("run", case(rows=data), "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 2 and "columns.sex" in ran.stderr and "input.parquet" in ran.stderr, ran.stderr
    assert_public(ran, "SECRETVALUE")
    nested_unit = base_rows() | {"pid": pa.array([[1], [2], [3], [4]])}
    with pytest.raises(InputSchemaError, match="privacy_unit 'pid'"):
        run_release(case(rows=nested_unit), key_file=tmp_path / "k2.key", out_dir=tmp_path / "out2")
    assert not (tmp_path / "k.key").exists() and not (tmp_path / "k2.key").exists()


def test_every_file_of_an_input_directory_is_checked_before_any_reservation(case, tmp_path):
    spec = case(input={"path": "parts"})
    parts = spec.parent / "parts"
    parts.mkdir()
    pq.write_table(pa.table(base_rows()), parts / "a.parquet")
    pq.write_table(pa.table({k: v for k, v in base_rows().items() if k != "age"}), parts / "b.parquet")
    (parts / "c.parquet").write_bytes(b"not parquet at all: SECRETVALUE")
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(5))
    ran = cli("run", spec, "--ledger", book, "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 2, ran.stderr
    assert "b.parquet: missing column(s) ['age']" in ran.stderr
    assert "c.parquet: cannot be read as parquet" in ran.stderr
    assert_public(ran, "SECRETVALUE")
    assert history(open_ledger(book), "test-data")[1] == [] and not (tmp_path / "k.key").exists()


def test_an_unexpected_failure_prints_one_public_line_and_details_only_internally(case, tmp_path, monkeypatch):
    from dprelease.pipelines import api as api_module
    from dprelease.pipelines import cli as cli_module

    def leak(*args, **kwargs):
        raise ValueError(f"cannot convert value {SECRET_INT}")

    monkeypatch.setattr(api_module, "run_release_spec", leak)
    spec = case()
    quiet = CliRunner().invoke(cli_module.main, ["run", str(spec), "--no-ledger"])
    assert quiet.exit_code == 1
    assert "ValueError" in quiet.output and str(SECRET_INT) not in quiet.output and "--internal-dir" in quiet.output
    internal = tmp_path / "internal"
    kept = CliRunner().invoke(cli_module.main, ["run", str(spec), "--no-ledger", "--internal-dir", str(internal)])
    assert kept.exit_code == 1 and str(SECRET_INT) not in kept.output
    (report,) = internal.glob("failure-run-*.txt")
    assert str(SECRET_INT) in report.read_text() and stat.S_IMODE(report.stat().st_mode) == 0o600


# 7. Spill and staging files ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_spill_files_are_private_and_removed(case, tmp_path, monkeypatch, workers):
    """One process spilling, and two workers each spilling its read tasks' records: every spill file is 0600 in a
    0700 directory, and nothing is left afterwards."""
    monkeypatch.setattr(embedded_module, "PARTITION_BYTES", 16)  # force several spill partitions
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    seen = []

    def look():
        for directory in (tmp_path / "tmp").iterdir():
            seen.append((directory.name, stat.S_IMODE(directory.stat().st_mode),
                         sorted(stat.S_IMODE(f.stat().st_mode) for f in directory.iterdir())))

    if workers == 1:
        original = embedded_module.EmbeddedEngine._accumulate

        def spy(*args, **kwargs):
            look()
            return original(*args, **kwargs)

        monkeypatch.setattr(embedded_module.EmbeddedEngine, "_accumulate", staticmethod(spy))
    else:
        in_workers = embedded_module.EmbeddedEngine._counts_in_workers

        def spy_workers(*args, **kwargs):
            counted = in_workers(*args, **kwargs)
            look()  # the workers' spill files are still there until the directory is removed
            return counted

        monkeypatch.setattr(embedded_module.EmbeddedEngine, "_counts_in_workers", spy_workers)
    run_release(case(), key_file=tmp_path / "k.key", out_dir=tmp_path / "out", workers=workers)
    assert seen, "the spill directory was never seen"
    for name, mode, file_modes in seen:
        assert name.startswith("dprelease-spill-test-release@") and mode == 0o700
        assert file_modes and set(file_modes) == {0o600}
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_large_input_file_is_parsed_from_a_copy_without_a_name(case, tmp_path, monkeypatch):
    """A file above IN_MEMORY_BYTES is copied for parsing into a temporary file that has no name: nothing of it is
    in TMPDIR while it is read, so no killed reader (a worker, an executor) can leave a copy of the input behind."""
    import hashlib
    import tempfile

    from dprelease.pipelines.storage import FileDigest, counted

    data = case().parent / "input.parquet"
    body = data.read_bytes()
    monkeypatch.setattr(counted, "IN_MEMORY_BYTES", 0)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    copy = counted.verified_copy(str(data), None, FileDigest(len(body), hashlib.sha256(body).hexdigest()), "input")
    assert list((tmp_path / "tmp").iterdir()) == []
    assert pq.read_table(copy).equals(pq.read_table(data))
    assert list((tmp_path / "tmp").iterdir()) == []


def _demo_case(tmp_path: Path, rows: int) -> Path:
    from dprelease.pipelines.commands import demo_data

    from .conftest import DEMO_SPEC

    directory = tmp_path / "demo"
    demo_data(rows, directory / "data", seed=3)
    (directory / "spec.yaml").write_text(DEMO_SPEC.read_text())
    (directory / "geography.txt").write_bytes((directory / "data" / "geography.txt").read_bytes())
    return directory / "spec.yaml"


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


DROPPED_SIGTERM = """
import os, signal, sys
import dprelease.pipelines.run as run
where = sys.argv.pop(1)
real = getattr(run, where)

class Dropper:
    def __del__(self):  # the SIGTERM handler runs here, and Python prints and drops what it raises
        os.kill(os.getpid(), signal.SIGTERM)

def dropping(*args, **kwargs):
    Dropper()
    return real(*args, **kwargs)

setattr(run, where, dropping)
from dprelease.pipelines.cli import entry
entry()  # the console script's function
"""


@pytest.mark.parametrize("where, rows", [("post_process", [ABORTED]), ("clean_leftovers", [])])
def test_a_sigterm_whose_exception_a_callback_dropped_publishes_nothing(case, tmp_path, where, rows):
    """Found under load in CI: a SIGTERM that arrives while Python runs a callback whose exceptions it drops
    (logging's at-fork hook as the worker pool forks; here a finalizer) lost its `Terminated`, and the run went on
    to commit and publish, exit 0. The run now checks for a handled SIGTERM before each irreversible step (found
    by review: one dropped before the reservation still reserved and, for a selection, charged for good): nothing
    is charged or published, and it exits as terminated. Dropped before the reservation, nothing is reserved."""
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    ran = subprocess.run([sys.executable, "-c", DROPPED_SIGTERM, where, "run", str(case()), "--ledger", str(book),
                          "--key-file", str(tmp_path / "k.key"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert "Exception ignored" in ran.stderr and "Terminated" in ran.stderr  # the exception was dropped
    assert ran.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), ran.stderr[-2000:]
    assert not (tmp_path / "out" / "test-release").exists()
    assert [r.status for r in history(open_ledger(book), "test-data")[1]] == rows


def test_any_command_ends_as_terminated_after_a_dropped_sigterm():
    """The mechanism itself (`housekeeping.terminate_as_exit`, under every command that writes): a block whose
    SIGTERM exception a finalizer dropped ends as terminated (exit 143), not as a success."""
    code = ("import os, signal\n"
            "from dprelease.pipelines.housekeeping import terminate_as_exit\n"
            "class Dropper:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "with terminate_as_exit():\n"
            "    Dropper()\n"
            "print('finished')\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Exception ignored" in ran.stderr and ran.returncode == 128 + signal.SIGTERM
    assert "finished" not in ran.stdout


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGHUP])
def test_a_killed_run_leaves_nothing_behind_after_the_next_run(tmp_path, signum, workers):
    """SIGTERM (sent twice, as a supervisor escalating does) or SIGHUP (a dropped session; found by review: it killed
    the run outright): the run cleans up itself (spill, reservation) at once.
    SIGKILL: `ledger reconcile` releases the reservation and the next run of the release removes the dead run's
    spill directory. With 2 workers reading the input, no worker outlives the run (none holds records or the key
    after a SIGKILL of the main process)."""
    spec = _demo_case(tmp_path, 1_000_000)  # about a second of reading with the spill directory present
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(os.environ, TMPDIR=str(temp), DPRELEASE_LEASE_SECONDS="1", DPRELEASE_LEASE_GRACE_SECONDS="0")
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "demo-census", "rho", Fraction(10))
    # with 2 workers the input spills in 1 MiB partitions, so the workers read and count it
    # SIGHUP at its default action, as in a terminal (a runner under nohup ignores it, and so would the run)
    setup = "import signal; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    if workers > 1:
        setup += "from dprelease.pipelines.engines import embedded; embedded.PARTITION_BYTES = 1 << 20; "
    # entry(), not main(): the console script's function, with its collection before the interpreter exits
    # (main() alone once aborted at exit in CI: apache/arrow#34314)
    launch = ["-c", setup + "from dprelease.pipelines.cli import entry; entry()"]
    command = [sys.executable, *launch, "run", str(spec), "--ledger", str(book),
               "--key-file", str(tmp_path / "k.key"), "--out", str(tmp_path / "out"), "--workers", str(workers)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    spilling = lambda: any(p.name.startswith("dprelease-spill-demo-2026@") for p in temp.iterdir())  # noqa: E731
    assert _wait_for(spilling), "the run never created its spill directory"
    if workers > 1:
        assert _wait_for(lambda: len(_children(process.pid)) >= workers), "the workers never started"
        children = _children(process.pid)
        assert spilling(), "the workers started after the input was counted"
    process.send_signal(signum)
    if signum != signal.SIGKILL:
        time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)
    process.communicate(timeout=60)
    assert process.returncode in (-signum, 128 + signum)
    if workers > 1:
        assert _wait_for(lambda: not any(_alive(c) for c in children), timeout=10), "a worker outlived the run"
    rows = history(open_ledger(book), "demo-census")[1]
    if signum != signal.SIGKILL:
        assert not spilling() and [r.status for r in rows] == [ABORTED]
    else:
        assert spilling()
        time.sleep(1.5)  # the killed run's lease expires
        settled = cli("ledger", "reconcile", "--ledger", book, env=env)
        assert settled.returncode == 0 and [r.status for r in history(open_ledger(book), "demo-census")[1]] == [ABORTED]
    assert not (tmp_path / "out" / "demo-2026").exists()
    host = host_identity()
    stray = tmp_path / "out" / f".demo-2026.staging@1.1@{host}@dead"  # a staging dir of a long-dead run
    stray.mkdir(parents=True)
    other = temp / f"dprelease-spill-other-release@1.1@{host}@x"  # another release's: never touched
    other.mkdir()
    elsewhere = tmp_path / "out" / ".demo-2026.staging@1.1@another-host@x"  # another host's (shared dir)
    elsewhere.mkdir()
    again = subprocess.run(command, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert not spilling() and other.exists() and not stray.exists() and elsewhere.exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [elsewhere.name, "demo-2026"]
    assert json.loads((tmp_path / "out" / "demo-2026" / "manifest.json").read_text())["ledger"]["charged"] == "1"


def test_without_proc_no_directory_is_taken_for_a_dead_runs(tmp_path, monkeypatch):
    """Found by review: where /proc cannot be read every process's start time was unknown, so every run's
    directories (the sweeping run's own included) were taken for dead ones and removed. Now nothing is told dead
    there; with /proc, a dead run's directory goes and a live one (this process's) stays."""
    from dprelease.pipelines import housekeeping

    host = housekeeping.host_identity()
    dead = tmp_path / f"dprelease-publish@4194303.1@{host}@x1"
    live = tmp_path / f"dprelease-publish@{housekeeping.process_token()}@{host}@x2"
    for directory in (dead, live):
        directory.mkdir()
    with monkeypatch.context() as patched:
        patched.setattr(housekeeping, "_start_ticks", lambda pid: None)
        assert housekeeping.remove_stale(tmp_path, "dprelease-publish@") == [] and dead.exists() and live.exists()
    assert housekeeping.remove_stale(tmp_path, "dprelease-publish@") == [dead] and live.exists()


def test_a_process_of_another_pid_namespace_is_never_told_dead(tmp_path):
    """Found by review: two containers sharing a host name and a TMPDIR (or output directory) but not their PID
    namespace could take each other's live directories for dead ones (the other's pid is absent from this /proc)
    and remove them mid-run. The tag names the PID namespace; a directory of another namespace, or of the host name
    alone (written before namespaces were named), is never removed."""
    from dprelease.pipelines import housekeeping

    other_namespace = tmp_path / f"dprelease-publish@4194303.1@{socket.gethostname()}~1@x1"
    hostname_only = tmp_path / f"dprelease-publish@4194303.1@{socket.gethostname()}@x2"
    this_namespace = tmp_path / f"dprelease-publish@4194303.1@{housekeeping.host_identity()}@x3"
    for directory in (other_namespace, hostname_only, this_namespace):
        directory.mkdir()
    assert housekeeping.leftover_tag().endswith(f"@{housekeeping.host_identity()}@")
    assert housekeeping.process_alive(f"{socket.gethostname()}~1", "4194303.1") is None
    assert housekeeping.remove_stale(tmp_path, "dprelease-publish@") == [this_namespace]
    assert other_namespace.exists() and hostname_only.exists()


def test_a_process_whose_proc_entry_is_hidden_is_never_told_dead(tmp_path, monkeypatch):
    """Found by review: with /proc mounted `hidepid`, another user's live run has no readable entry, and was told
    dead (its directories, or its result directory in a shared store, removed mid-run). Only a pid no process has,
    or one whose start time differs, is dead."""
    from dprelease.pipelines import housekeeping

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        token = housekeeping.process_token(sleeper.pid)
        identity = housekeeping.host_identity()
        assert housekeeping.process_alive(identity, token) is True
        real = housekeeping._start_ticks
        with monkeypatch.context() as patched:
            patched.setattr(housekeeping, "_start_ticks", lambda pid: None if pid == sleeper.pid else real(pid))
            assert housekeeping.process_alive(identity, token) is None
            live = tmp_path / f"dprelease-publish@{token}@{identity}@x1"
            live.mkdir()
            assert housekeeping.remove_stale(tmp_path, "dprelease-publish@") == [] and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert housekeeping.process_alive(identity, token) is False  # gone now: no process has the pid, or another one
    assert housekeeping.process_alive(identity, "0.1") is False


def test_a_host_name_with_the_tags_separators_is_written_plain(tmp_path, monkeypatch):
    """Found by review: a host name holding '+' or '@' cut the tags short, so no leftover of a killed run was ever
    removed; the identity also holds this machine's boot id (the PID namespace's inode is the same on every host)."""
    from dprelease.pipelines import housekeeping

    monkeypatch.setattr(housekeeping.socket, "gethostname", lambda: "node+1@rack~2")
    identity = housekeeping.host_identity()
    assert not set("@+~") & set(identity.split("~")[0]) and identity.count("~") == 2
    assert identity.split("~")[1] == housekeeping._boot_id() != "0"
    dead = tmp_path / f"dprelease-publish@4194303.1@{identity}@x1"
    dead.mkdir()
    assert housekeeping.remove_stale(tmp_path, "dprelease-publish@") == [dead]
    assert housekeeping._plain_name("a+b") != housekeeping._plain_name("a_b")


def test_a_forked_child_reads_its_own_pid_namespace_and_boot_again():
    """Found by review: the boot id and PID namespace, read once per process, were inherited by a child forked after
    `unshare(CLONE_NEWPID)`, which is in another namespace: its leftovers were tagged with the parent's and swept by
    the parent while alive. A forked child reads them again."""
    import os

    from dprelease.pipelines import housekeeping

    housekeeping.host_identity()
    assert housekeeping._pid_namespace.cache_info().currsize == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(housekeeping._pid_namespace.cache_info().currsize + housekeeping._boot_id.cache_info().currsize).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 8) == b"0"
    os.waitpid(pid, 0)

"""Hostile release directories (issue 18, items 16-21): `verify`, `report`, `synthesize` and `ledger reconcile`
read files anyone may have written. Each case below tampers with a real release (re-hashing the manifest
where the tampering would otherwise be caught by a hash) and demands a mismatch or a one-line error, in
bounded time and memory, never a read or a write outside the release, never a traceback."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from dprelease.accounting.ledger import open_ledger, reserve, set_budget
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release

from .conftest import GEO_LEAVES, small_spec, write_case

SECRET_LINE = "root:x:0:0:hostile-marker"
TIMEOUT = 60
MEMORY_LIMIT = 3 << 30


LIMITED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
           "sys.argv = ['dprelease'] + sys.argv[1:]; runpy.run_module('dprelease.pipelines.cli', run_name='__main__')")


def cli(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """The CLI with a wall-clock limit and an address-space limit (a read of /dev/zero would exceed it), set
    by the child itself (a preexec_fn would fork a test process that may hold gRPC threads)."""
    return subprocess.run([sys.executable, "-c", LIMITED.format(MEMORY_LIMIT), *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A release of every kind of table, run against a ledger with a monthly budget."""
    root = tmp_path_factory.mktemp("hostile")
    columns = {**small_spec()["columns"], "income": {"type": "integer", "min": 0, "max": 10**5, "clamp": [0, 1000]}}
    queries = small_spec()["queries"] + [
        {"name": "total", "kind": "sum", "column": "income", "by": ["geo.county"]},
        {"name": "avg", "kind": "mean", "column": "income", "by": ["sex"]},
        {"name": "median", "kind": "quantile", "column": "income", "q": [0.5], "candidates": [0, 100, 500, 1000]},
    ]
    rng = np.random.default_rng(3)
    n = 600
    rows = {"pid": list(range(n)), "geo": rng.choice(GEO_LEAVES, n).tolist(), "age": rng.integers(0, 99, n).tolist(),
            "sex": rng.choice(["F", "M"], n).tolist(), "income": rng.integers(0, 2000, n).tolist()}
    spec = write_case(root / "case", small_spec(period="2026-11", columns=columns, queries=queries), rows)
    book = root / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10), Fraction(2))
    result = run_release(spec, key_file=root / "k.key", out_dir=root / "out", ledger=book)
    return result.release_dir, book


@pytest.fixture
def release(published, tmp_path):
    copy = tmp_path / "out" / "test-release"
    shutil.copytree(published[0], copy)
    return copy


def manifest_of(release: Path) -> dict:
    return json.loads((release / "manifest.json").read_text())


def write_manifest(release: Path, manifest: dict) -> None:
    (release / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def rehash(release: Path) -> None:
    """Recompute every listed file's hash and size: only what the hashes cannot catch is left to find."""
    manifest = manifest_of(release)
    for entry in manifest["files"]:
        path = release / entry["path"]
        if path.is_file() and not path.is_symlink():
            entry.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size)
    write_manifest(release, manifest)


def edit_table(release: Path, relative: str, change, csv: bool = True) -> None:
    """Apply `change(table) -> table` to a table's Parquet file (and its CSV twin), then re-hash."""
    path = release / f"{relative}.parquet"
    table = change(pq.read_table(path))
    pq.write_table(table, path)
    if csv:
        pacsv.write_csv(table, release / f"{relative}.csv")
    rehash(release)


def set_column(table: pa.Table, name: str, values) -> pa.Table:
    index = table.column_names.index(name)
    return table.set_column(index, name, pa.array(values, type=table.schema.field(name).type))


def problems(release: Path, **kwargs) -> list[str]:
    found = verify_release(release, **kwargs).problems
    assert found, "the tampered release verified"
    return found


def test_the_untouched_release_verifies_everywhere(release, published):
    assert verify_release(release, ledger=str(published[1]), recompute=True).ok
    ran = cli("verify", release, "--ledger", published[1], "--recompute")
    assert ran.returncode == 0 and "OK" in ran.stdout, ran.stderr


# ---- 16. reads only regular files inside the release -----------------------------------------------------------------

def test_a_domain_file_named_outside_the_release_is_never_read(release, tmp_path):
    """Main followed the embedded spec's domain_file: its lines were printed and put into the HTML report."""
    outside = tmp_path / "passwd"
    outside.write_text(f"{SECRET_LINE}\n")
    manifest = manifest_of(release)
    manifest["spec"]["columns"]["geo"]["domain_file"] = str(outside)
    manifest["domain_files"]["geo"] = str(outside)
    write_manifest(release, manifest)
    ran = cli("verify", release)
    assert ran.returncode == 1 and SECRET_LINE not in ran.stdout + ran.stderr
    report = cli("report", release, "--out", tmp_path / "r.html")
    assert report.returncode == 1 and SECRET_LINE not in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("target", ["passwd", "/dev/zero"])
def test_a_domain_file_that_is_a_link_is_never_followed(release, tmp_path, target):
    outside = tmp_path / "passwd"
    outside.write_text(f"{SECRET_LINE}\n")
    domain = release / "domains" / "geo.txt"
    domain.unlink()
    domain.symlink_to(outside if target == "passwd" else target)
    ran = cli("verify", release)
    assert ran.returncode == 1 and "symbolic link" in ran.stderr and SECRET_LINE not in ran.stdout + ran.stderr


@pytest.mark.parametrize("name", ["domains/geo.txt", "manifest.json", "tables/pop.state.parquet"])
def test_a_fifo_in_the_release_never_hangs(release, tmp_path, name):
    (release / name).unlink()
    os.mkfifo(release / name)
    for command in (["verify", release], ["report", release, "--out", tmp_path / "r.html"],
                    ["synthesize", release, "--out", tmp_path / "s.parquet"]):
        ran = cli(*command)
        assert ran.returncode in (1, 2) and "Traceback" not in ran.stderr, (command, ran.stderr)


def test_a_manifest_that_is_a_link_to_the_zero_device_is_refused(release):
    (release / "manifest.json").unlink()
    (release / "manifest.json").symlink_to("/dev/zero")
    ran = cli("verify", release)
    assert ran.returncode == 1 and "manifest.json" in ran.stderr and "Traceback" not in ran.stderr


# ---- 17. sizes, digits and nesting bounded before parsing -----------------------------------------------------------

def test_a_huge_exact_weight_in_the_manifest_answers_in_seconds(release):
    """A 20-byte edit made main's verify and plan run for 740 s at 326 MB."""
    manifest = manifest_of(release)
    manifest["spec"]["queries"][0]["weight"] = "1e-100000000"
    write_manifest(release, manifest)
    ran = cli("verify", release)
    assert ran.returncode == 1 and "weight" in ran.stderr and "Traceback" not in ran.stderr


@pytest.mark.parametrize("payload", ["[" * 100_000 + "]" * 100_000, "9" * 5000])
def test_deep_nesting_and_long_integers_in_the_manifest_are_mismatches(release, payload):
    text = (release / "manifest.json").read_text()
    (release / "manifest.json").write_text(text.replace('"engine": "embedded"', f'"engine": {payload}'))
    ran = cli("verify", release)
    assert ran.returncode == 1 and "manifest.json" in ran.stderr and "Traceback" not in ran.stderr
    assert "set_int_max_str_digits" not in ran.stderr


# ---- 18. data never becomes markup -----------------------------------------------------------------------------------

def test_markup_in_a_manifest_prints_as_text(release):
    manifest = manifest_of(release)
    manifest["software"]["version"] = "\n[bold green]OK[/]: every file hash, allocation, mechanism and total matches."
    manifest["release_id"] = "x[/]y"
    write_manifest(release, manifest)
    ran = cli("verify", release)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    assert not any(line.startswith("OK") for line in ran.stdout.splitlines()), ran.stdout
    assert "\\n[bold green]OK[/]" in ran.stdout and "x[/]y" in ran.stdout


def test_brackets_in_messages_survive(case):
    """Main's console took '[lo, hi]' for a markup tag and dropped it."""
    ran = cli("plan", case(columns={**small_spec()["columns"], "income": {"type": "integer", "min": 0, "max": 9,
                                                                          "clamp": [1, 2, 3]}}))
    assert ran.returncode == 2 and "must be [lo, hi]" in ran.stderr, ran.stderr


# ---- 19. every structural property the release claims ------------------------------------------------------------------

def _state_plus_1000(table):
    counts = table.column("count").to_numpy().copy()
    counts[0] += 1000
    return set_column(table, "count", counts)


def _negative(table):
    counts = table.column("count").to_numpy().copy()
    counts[-1] = -3
    return set_column(table, "count", counts)


def _swap_labels(table):
    labels = table.column("state").to_pylist()
    labels[0], labels[1] = labels[1], labels[0]
    return set_column(table, "state", labels)


TABLE_EDITS = {
    "state count +1000": ("tables/pop.state", _state_plus_1000, "does not add up"),
    "negative count": ("tables/pop.tract", _negative, "negative"),
    "swapped labels": ("tables/pop.state", _swap_labels, "labels"),
    "extra column": ("tables/pop.state", lambda t: t.append_column("true_count", pa.array([1] * t.num_rows)),
                     "columns"),
    "dropped label column": ("tables/pop.county", lambda t: t.drop_columns(["county"]), "columns"),
    "mean -1e9": ("tables/avg", lambda t: set_column(t, "mean", [-1e9] * t.num_rows), "outside the clamp"),
    "mean NaN": ("tables/avg", lambda t: set_column(t, "mean", [float("nan")] * t.num_rows), "NaN"),
    "quantile not a candidate": ("tables/median", lambda t: set_column(t, "value", [7] * t.num_rows), "candidates"),
    "negative sum with lo >= 0": ("tables/total", lambda t: set_column(t, "sum", [-5] * t.num_rows), "negative"),
    "nonnegative marginal off its total": (
        "tables/agesex.age-sex", lambda t: set_column(t, "count", t.column("count").to_numpy() + 1), "unit totals"),
}


@pytest.mark.parametrize("edit", sorted(TABLE_EDITS))
def test_table_edits_are_mismatches_even_rehashed(release, edit):
    relative, change, expected = TABLE_EDITS[edit]
    edit_table(release, relative, change)
    found = problems(release)
    assert any(expected in p for p in found), found


def test_counts_that_wrap_around_int64_never_add_up(release):
    """Tracts of 2^63 - 1 wrapped around to their county's total in main's int64 sums."""
    def wrap(table):
        counts = table.column("count").to_numpy().copy()
        labels = table.column("tract").to_pylist()
        mine = [i for i, code in enumerate(labels) if code.startswith("02005")]
        counts[mine[0]] = counts[mine[1]] = 2**63 - 1
        counts[mine[2]] = int(pq.read_table(release / "tables" / "pop.county.parquet").to_pydict()["count"][
            pq.read_table(release / "tables" / "pop.county.parquet").column("county").to_pylist().index("02005")]) + 2
        return set_column(table, "count", counts)

    edit_table(release, "tables/pop.tract", wrap)
    assert any("above" in p for p in problems(release))


def test_a_parquet_file_with_too_many_rows_is_refused_from_its_footer(release):
    big = pa.table({"sex": pa.array(["F"] * 3_000_000), "noisy_count": pa.array(np.zeros(3_000_000, dtype=np.int64))})
    pq.write_table(big, release / "measurements" / "by_sex.parquet")  # 20 kB compressed
    rehash(release)
    import resource as res
    before = res.getrusage(res.RUSAGE_SELF).ru_maxrss
    found = problems(release)
    assert any("rows, the public domain has" in p for p in found)
    assert res.getrusage(res.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: the rows were never decoded


def test_a_sparse_file_claiming_terabytes_is_never_hashed(release):
    path = release / "tables" / "pop.state.csv"
    with open(path, "r+b") as handle:
        handle.truncate(1 << 40)
    manifest = manifest_of(release)
    for entry in manifest["files"]:
        if entry["path"] == "tables/pop.state.csv":
            entry["bytes"] = 1 << 40
    write_manifest(release, manifest)
    ran = cli("verify", release)
    assert ran.returncode == 1 and "more than a file of this release can hold" in ran.stderr


def test_a_manifest_listing_millions_of_files_stays_bounded(release):
    manifest = manifest_of(release)
    manifest["files"] = manifest["files"] + [{}] * 2_000_000
    write_manifest(release, manifest)
    ran = cli("verify", release)
    assert ran.returncode == 1 and "further problems not listed" in ran.stderr and len(ran.stderr) < 1_000_000


@pytest.mark.parametrize("edit", [lambda m: m.update(spec=[]), lambda m: m.update(manifest_version="3")])
def test_verify_against_a_ledger_never_tracebacks(release, published, edit):
    manifest = manifest_of(release)
    edit(manifest)
    write_manifest(release, manifest)
    ran = cli("verify", release, "--ledger", published[1])
    assert ran.returncode == 1 and "Traceback" not in ran.stderr


def test_verify_never_creates_a_ledger(release, tmp_path):
    ran = cli("verify", release, "--ledger", tmp_path / "new.sqlite")
    assert ran.returncode == 2 and "no such ledger file" in ran.stderr and not (tmp_path / "new.sqlite").exists()


def test_a_csv_that_differs_from_its_parquet_is_a_mismatch(release):
    path = release / "tables" / "pop.state.csv"
    path.write_text(path.read_text().replace(",", ",9", 3))
    rehash(release)
    assert any("differs from tables/pop.state.parquet" in p or "pop.state.csv" in p for p in problems(release))


def test_a_wrong_variance_in_the_csv_only_is_a_mismatch(release):
    table = pq.read_table(release / "tables" / "pop.tract.parquet")
    pacsv.write_csv(set_column(table, "gls_variance", table.column("gls_variance").to_numpy() * 2),
                    release / "tables" / "pop.tract.csv")
    rehash(release)
    assert any("pop.tract.csv: differs" in p for p in problems(release))


def test_tables_that_are_not_the_post_processing_of_the_measurements_need_recompute(release):
    def bump(table):
        counts = table.column("count").to_numpy().copy()
        counts[0] += 1
        counts[1] -= 1  # still nonnegative (or caught as such), still adding up to the same county
        return set_column(table, "count", counts)

    table = pq.read_table(release / "tables" / "pop.tract.parquet").column("count").to_numpy()
    if table[1] == 0:
        pytest.skip("the first tract pair cannot be shifted by one")
    edit_table(release, "tables/pop.tract", bump)
    assert verify_release(release).ok  # structurally sound: only recomputing can tell
    assert any("differ from the post-processing" in p for p in problems(release, recompute=True))


LEDGER_EDITS = {
    "lifetime budget": lambda b: b.update(lifetime_budget="100"),
    "free rerun costing nothing": lambda b: b.update(rerun_of_committed_release=True, charged="0",
                                                      charged_by_this_run="0", spent_after=b["spent_before"]),
    "invented period budget": lambda b: b["period_budget"].update(budget="20"),
}


@pytest.mark.parametrize("edit", sorted(LEDGER_EDITS))
def test_ledger_block_edits_are_caught_against_the_ledger(release, published, edit):
    manifest = manifest_of(release)
    LEDGER_EDITS[edit](manifest["ledger"])
    write_manifest(release, manifest)
    found = problems(release, ledger=str(published[1]))
    assert any("not a manifest this ledger recorded" in p for p in found), found


def test_a_manifest_that_claims_no_ledger_is_caught_against_the_ledger(release, published):
    manifest = manifest_of(release)
    manifest["ledger"] = None
    write_manifest(release, manifest)
    assert verify_release(release).ok  # nothing inside the release contradicts it
    assert any("not run against a ledger" in p for p in problems(release, ledger=str(published[1])))


# ---- 20. synthesize and report write beside a release, never into it or over other files ---------------------------

def test_synthesize_refuses_an_existing_file_and_paths_inside_a_release(release, tmp_path):
    victim = tmp_path / "input.parquet"
    victim.write_bytes(b"precious")
    ran = cli("synthesize", release, "--out", victim)
    assert ran.returncode == 2 and "exists" in ran.stderr and victim.read_bytes() == b"precious"
    before = (release / "manifest.json").read_bytes()
    ran = cli("synthesize", release, "--out", release / "manifest.json", "--overwrite")
    assert ran.returncode == 2 and "inside the release" in ran.stderr
    assert (release / "manifest.json").read_bytes() == before
    link = tmp_path / "link.parquet"
    link.symlink_to(victim)
    ran = cli("synthesize", release, "--out", link, "--overwrite")
    assert ran.returncode == 2 and "symbolic link" in ran.stderr and victim.read_bytes() == b"precious"


@pytest.mark.parametrize("command", ["synthesize", "report"])
def test_commands_run_inside_a_release_write_beside_it(release, command):
    """`synthesize .` and `report .` inside a release wrote into it (it then failed verify)."""
    ran = cli(command, ".", cwd=release)
    assert ran.returncode in (0, 2), ran.stderr
    assert verify_release(release).ok
    assert {p.name for p in release.parent.iterdir()} <= {"test-release", "test-release.report.html",
                                                         "test-release.synthetic.parquet",
                                                         "test-release.synthetic.parquet.utility.json"}


def test_synthesize_refuses_more_records_than_the_cap(release, tmp_path):
    ran = cli("synthesize", release, "--out", tmp_path / "s.parquet", "--max-records", 10)
    assert ran.returncode == 2 and "--max-records" in ran.stderr and not (tmp_path / "s.parquet").exists()


# ---- 21. reconcile reads only regular files -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_reconcile_never_hangs_on_a_special_manifest(tmp_path, kind, monkeypatch):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "d", "rho", Fraction(5))
    monkeypatch.setenv("DPRELEASE_LEASE_SECONDS", "1")
    directory = tmp_path / "out" / "r"
    directory.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(directory / "manifest.json")
    else:
        (directory / "manifest.json").symlink_to("/dev/zero")
    reserve(open_ledger(book), "d", "r", "k", "s", "rho", Fraction(1), release_dir=str(directory), owner="h:1.1")
    env = dict(os.environ, DPRELEASE_LEASE_GRACE_SECONDS="0")
    import time
    time.sleep(1.2)
    ran = cli("ledger", "reconcile", "--ledger", book, env=env)
    assert ran.returncode == 0 and "aborted" in ran.stdout, ran.stderr

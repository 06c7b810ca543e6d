"""Budget and key hardening: a key serves one release, publishing and charging are one outcome,
killed runs are reconciled, and key files are private and never inside a release tree."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dprelease.accounting.errors import KeyReuseError, PublishError, SpecError
from dprelease.accounting.ledger import (ABORTED, COMMITTED, RESERVED, LedgerError, history, open_ledger, reserve,
                                         set_budget)
from dprelease.pipelines import release as release_module
from dprelease.pipelines.housekeeping import owner_alive, process_token
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import published_manifest_sha256, verify_release

from .conftest import GEO_LEAVES, REPO

ROWS = 400


def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, **kwargs)


def rows(shift: int = 0) -> dict:
    """ROWS persons spread over the tracts; `shift` moves the first `shift` persons to another tract."""
    rng = np.random.default_rng(7)
    geo = [GEO_LEAVES[i] for i in rng.integers(0, len(GEO_LEAVES), ROWS)]
    for i in range(shift):
        geo[i] = GEO_LEAVES[(GEO_LEAVES.index(geo[i]) + 1) % len(GEO_LEAVES)]
    return {"pid": list(range(ROWS)), "geo": geo, "age": [int(a) for a in rng.integers(0, 100, ROWS)],
            "sex": [["F", "M"][int(s)] for s in rng.integers(0, 2, ROWS)]}


def noisy(release_dir: Path, table: str = "pop.tract") -> np.ndarray:
    return pq.read_table(release_dir / "measurements" / f"{table}.parquet").column("noisy_count").to_numpy()


def statuses(book: Path, dataset: str = "test-data") -> list[str]:
    return [row.status for row in history(open_ledger(book), dataset)[1]]


# 1. A key serves one release, one spec and one input ---------------------------------------------------------------

def test_one_key_over_changed_input_never_publishes_the_true_difference(case, tmp_path):
    """Without a ledger, the same key over a corrected input draws independent noise: the difference of
    the two releases is not the true change (on main it was, exactly, in every cell)."""
    key = tmp_path / "k.key"
    first = run_release(case(rows=rows()), key_file=key, out_dir=tmp_path / "a")
    second = run_release(case(rows=rows(shift=40)), key_file=key, out_dir=tmp_path / "b")
    true_change = np.zeros(len(GEO_LEAVES), dtype=np.int64)
    for before, after in zip(rows()["geo"], rows(shift=40)["geo"]):
        true_change[GEO_LEAVES.index(before)] -= 1
        true_change[GEO_LEAVES.index(after)] += 1
    difference = noisy(second.release_dir) - noisy(first.release_dir)
    assert not np.array_equal(difference, true_change)
    all_cells = np.concatenate([noisy(second.release_dir, t.name) - noisy(first.release_dir, t.name)
                                for t in first.plan.tables if t.name != "pop.tract"])
    assert np.count_nonzero(all_cells) > len(all_cells) // 3  # fresh noise, not a difference of true counts


def test_a_free_rerun_after_a_domain_file_edit_is_refused(case, tmp_path):
    """The spec hash names the domain file, not its contents: one tract added in front shifts every cell,
    and the same noise over shifted cells would publish exact differences of true counts. The plan
    fingerprint (domain contents, calibration, noise version) binds the key and the ledger row."""
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "rho", Fraction(10))
    spec = case(rows=rows(), budget={"definition": "zcdp", "rho": 1})
    run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "a")
    geo = spec.parent / "geo.txt"
    geo.write_text("01000000100\n" + geo.read_text())
    ran = cli("run", spec, "--ledger", book, "--key-file", tmp_path / "k.key", "--out", tmp_path / "b")
    assert ran.returncode == 2 and "different plan" in ran.stderr, ran.stderr
    assert statuses(book) == [COMMITTED] and not (tmp_path / "b" / "test-release").exists()


def test_a_release_committed_without_a_plan_fingerprint_is_not_rerun_free(case, tmp_path):
    """Rows from before plan fingerprints may have been drawn with other samplers or calibrations."""
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "rho", Fraction(10))
    spec = case(rows=rows(), budget={"definition": "zcdp", "rho": 1})
    run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "a")
    from sqlalchemy import update

    from dprelease.accounting.ledger import releases
    with open_ledger(book).begin() as connection:
        connection.execute(update(releases).values(plan_sha256=None))
    with pytest.raises(KeyReuseError, match="different plan"):
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "b")


def test_noise_binds_release_id_and_spec(case, tmp_path):
    key = tmp_path / "k.key"
    base = run_release(case(), key_file=key, out_dir=tmp_path / "a")
    renamed = run_release(case(release_id="another"), key_file=key, out_dir=tmp_path / "b")
    rebudgeted = run_release(case(budget={"definition": "pure", "epsilon": 2}), key_file=key, out_dir=tmp_path / "c")
    same = run_release(case(), key_file=key, out_dir=tmp_path / "d")
    assert not np.array_equal(noisy(base.release_dir, "pop.county"), noisy(renamed.release_dir, "pop.county"))
    assert not np.array_equal(noisy(base.release_dir, "agesex.age-sex"),
                              noisy(rebudgeted.release_dir, "agesex.age-sex"))
    for table in base.plan.tables:  # same key, release, spec and input: bit-identical
        assert np.array_equal(noisy(base.release_dir, table.name), noisy(same.release_dir, table.name))


def test_the_ledger_refuses_a_key_committed_for_another_spec_input_or_release(case, tmp_path):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "rho", Fraction(5000))
    key = tmp_path / "k.key"
    zcdp = {"definition": "zcdp", "rho": 1}
    spec = case(rows=rows(), budget=zcdp)
    first = run_release(spec, ledger=book, key_file=key, out_dir=tmp_path / "out")
    greedy = case(rows=rows(), budget={"definition": "zcdp", "rho": 1000})
    with pytest.raises(KeyReuseError, match="different spec"):
        run_release(greedy, ledger=book, key_file=key, out_dir=tmp_path / "out2")
    corrected = case(rows=rows(shift=3), budget=zcdp)
    refused = cli("run", corrected, "--ledger", book, "--key-file", key, "--out", tmp_path / "out", "--overwrite")
    assert refused.returncode == 2 and "different input" in refused.stderr, refused.stderr
    with pytest.raises(KeyReuseError, match="different release"):
        run_release(case(rows=rows(), budget=zcdp, release_id="other"), ledger=book, key_file=key,
                    out_dir=tmp_path / "out3")
    assert statuses(book) == [COMMITTED]
    assert verify_release(first.release_dir).ok
    again = run_release(case(rows=rows(), budget=zcdp), ledger=book, key_file=key, out_dir=tmp_path / "out4")
    assert json.loads((again.release_dir / "manifest.json").read_text())["ledger"]["charged_by_this_run"] == "0"
    for table in first.plan.tables:
        assert np.array_equal(noisy(first.release_dir, table.name), noisy(again.release_dir, table.name))
    assert statuses(book) == [COMMITTED]


def test_monthly_script_refuses_a_past_month_rerun_on_changed_data(tmp_path):
    from dprelease.pipelines.commands import demo_data

    series = tmp_path / "series"
    series.mkdir()
    shutil.copy(REPO / "examples" / "demo" / "monthly.yaml", series / "monthly.yaml")
    shutil.copy(REPO / "examples" / "demo" / "geography.txt", series / "geography.txt")
    demo_data(5_000, series / "data", seed=1)
    ledger = tmp_path / "ledger.sqlite"
    assert cli("ledger", "set-budget", "demo-census", "--rho", 10, "--ledger", ledger).returncode == 0
    script = REPO / "deploy" / "schedule" / "monthly-release.sh"
    month = ["bash", str(script), str(series / "monthly.yaml"), "2026-01", str(ledger), str(tmp_path / "keys")]
    assert subprocess.run(month, capture_output=True, text=True).returncode == 0
    published = series / "releases" / "demo-2026-01" / "manifest.json"
    before = published.read_bytes()
    demo_data(5_000, series / "data", overwrite=True, seed=2)  # the month's file corrected after publication
    rerun = subprocess.run([*month, "--overwrite"], capture_output=True, text=True)
    assert rerun.returncode == 2 and "different input" in rerun.stderr, rerun.stderr
    assert published.read_bytes() == before
    assert statuses(ledger, "demo-census") == [COMMITTED]


# 2. Published means charged ----------------------------------------------------------------------------------------

def test_overwrite_over_a_symlinked_release_is_refused_before_any_charge(case, tmp_path):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    spec = case()
    first = run_release(spec, ledger=book, key_file=tmp_path / "a.key", out_dir=tmp_path / "real")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "test-release").symlink_to(first.release_dir)
    ran = cli("run", spec, "--ledger", book, "--key-file", tmp_path / "b.key", "--out", tmp_path / "out", "--overwrite")
    assert ran.returncode == 2 and "symbolic link" in ran.stderr
    assert statuses(book) == [COMMITTED] and verify_release(first.release_dir).ok
    assert (tmp_path / "out" / "test-release").is_symlink()


def test_a_ledger_failing_at_commit_leaves_nothing_published(case, tmp_path, monkeypatch):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))

    def locked(*args, **kwargs):
        from sqlalchemy.exc import OperationalError

        raise OperationalError("COMMIT", {}, Exception("database is locked"))

    monkeypatch.setattr("dprelease.pipelines.run.commit", locked)
    with pytest.raises(Exception, match="locked"):
        run_release(case(), ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "test-release").exists()
    assert statuses(book) == [ABORTED]
    assert not [p for p in (tmp_path / "out").iterdir()]  # no staging left either


def test_a_failed_rename_after_commit_stays_charged_and_a_rerun_publishes_free(case, tmp_path, monkeypatch):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    spec = case()

    def refuse(source, target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(release_module, "rename_no_replace", refuse)
    with pytest.raises(PublishError, match="charged in the ledger but not published"):
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out")
    monkeypatch.undo()
    assert statuses(book) == [COMMITTED]  # never aborted: the charge stands
    again = run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out")
    block = json.loads((again.release_dir / "manifest.json").read_text())["ledger"]
    # item 11: the only published manifest states what the release cost (main said charged 0)
    assert (block["charged"], block["charged_by_this_run"], block["rerun_of_committed_release"]) == ("1", "0", True)
    assert statuses(book) == [COMMITTED]
    assert verify_release(again.release_dir, ledger=str(book)).ok
    forged = json.loads((again.release_dir / "manifest.json").read_text())
    forged["ledger"]["charged"] = "0"
    (again.release_dir / "manifest.json").write_text(json.dumps(forged, indent=2, sort_keys=True) + "\n")
    problems = verify_release(again.release_dir, ledger=str(book)).problems
    assert any("ledger.charged" in p for p in problems) and any("not a manifest this ledger recorded" in p
                                                                for p in problems)


def test_publish_never_replaces_a_directory_that_appeared_meanwhile(case, tmp_path, monkeypatch):
    """A concurrent run of the same release published between our check and our rename: the rename
    itself refuses (on main the second run silently replaced the first)."""
    first = run_release(case(), key_file=tmp_path / "a.key", out_dir=tmp_path / "out")
    monkeypatch.setattr(release_module, "check_target", lambda final_dir, overwrite: None)  # the race window
    marker = first.release_dir / "manifest.json"
    before = marker.read_bytes()
    staging = tmp_path / "out" / ".test-release.staging@1.1@host@x"
    staging.mkdir()
    (staging / "manifest.json").write_text("{}")
    with pytest.raises(SpecError, match="appeared while this run was writing"):
        release_module.publish(release_module.StagedRelease(staging, "0" * 64, "0" * 64), first.release_dir,
                               overwrite=False)
    assert marker.read_bytes() == before


# 3. Reconcile ------------------------------------------------------------------------------------------------------

def _dead_owner() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = process_token(child.pid)
    child.wait()
    import socket

    return f"{socket.gethostname()}:{token}"


def _short_leases(monkeypatch, lease: int = 1) -> None:
    monkeypatch.setenv("DPRELEASE_LEASE_SECONDS", str(lease))
    monkeypatch.setenv("DPRELEASE_LEASE_GRACE_SECONDS", "0")


def test_reconcile_settles_rows_whose_lease_expired(case, tmp_path, monkeypatch):
    book_path = tmp_path / "ledger.sqlite"
    book = open_ledger(book_path)
    set_budget(book, "test-data", "epsilon", Fraction(10))
    published = run_release(case(), key_file=tmp_path / "p.key", out_dir=tmp_path / "out")
    manifest = json.loads((published.release_dir / "manifest.json").read_text())
    dead = _dead_owner()
    _short_leases(monkeypatch)
    reserve(book, "test-data", "test-release", manifest["key_id"], manifest["spec_sha256"], "epsilon", Fraction(1),
            input_fingerprint="f", release_dir=str(published.release_dir), owner=dead)
    reserve(book, "test-data", "gone", "k2", "s", "epsilon", Fraction(1), input_fingerprint="f",
            release_dir=str(tmp_path / "out" / "gone"), owner=dead)
    monkeypatch.setenv("DPRELEASE_LEASE_SECONDS", "3600")
    # a live run whose owner LOOKS dead from here (another PID namespace under the same host name): its lease holds
    reserve(book, "test-data", "live", "k3", "s", "epsilon", Fraction(1), input_fingerprint="f",
            release_dir=str(tmp_path / "out" / "live"), owner=dead)
    time.sleep(1.2)
    shown = cli("ledger", "reconcile", "--dry-run", "--ledger", book_path)
    assert shown.returncode == 0 and "dry run" in shown.stdout
    assert statuses(book_path) == [RESERVED] * 3
    done = cli("ledger", "reconcile", "--ledger", book_path)
    assert done.returncode == 0, done.stderr
    assert statuses(book_path) == [COMMITTED, ABORTED, RESERVED]
    assert "holds a lease" in done.stdout
    committed = history(book, "test-data")[1][0]
    assert committed.manifest_sha256 == published_manifest_sha256(committed)
    assert owner_alive(dead) is False and owner_alive("elsewhere:1.1") is None


def test_a_live_run_that_looks_dead_is_left_and_publishes_charged(case, tmp_path, monkeypatch):
    """Item 8: on main, a run in another PID namespace with the same host name was judged dead by reconcile,
    which aborted its reservation; the run then published with 'charged 1' while the ledger spent 0."""
    import dprelease.pipelines.run as run_module

    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    _short_leases(monkeypatch, lease=2)
    monkeypatch.setattr(run_module, "owner", _dead_owner)  # as seen from the host that reconciles
    real = run_module.post_process

    def slow(plan, noisy, **options):
        time.sleep(2.5)  # longer than the lease: only renewals keep it
        assert cli("ledger", "reconcile", "--ledger", book).returncode == 0
        return real(plan, noisy, **options)

    monkeypatch.setattr(run_module, "post_process", slow)
    result = run_release(case(), ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out")
    assert statuses(book) == [COMMITTED] and verify_release(result.release_dir, ledger=str(book)).ok


def test_a_run_whose_reservation_was_reconciled_publishes_nothing(case, tmp_path, monkeypatch):
    """A run that stopped renewing (stalled past its lease) and was settled by reconcile cannot commit: commit
    checks its owner token on a still reserved row (main's commit silently updated 0 rows and published)."""
    import contextlib

    import dprelease.pipelines.run as run_module

    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    _short_leases(monkeypatch)
    monkeypatch.setattr(run_module, "LeaseKeeper", lambda *args, **kwargs: contextlib.nullcontext())
    real = run_module.post_process

    def stalled(plan, noisy, **options):
        time.sleep(1.5)
        assert cli("ledger", "reconcile", "--ledger", book).returncode == 0
        return real(plan, noisy, **options)

    monkeypatch.setattr(run_module, "post_process", stalled)
    with pytest.raises(LedgerError, match="no longer held"):
        run_release(case(), ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out")
    assert statuses(book) == [ABORTED]
    assert not (tmp_path / "out" / "test-release").exists()
    assert not [p for p in (tmp_path / "out").iterdir()]


# 4. Key files ------------------------------------------------------------------------------------------------------

def test_a_key_file_readable_by_others_is_refused(case, tmp_path):
    key = tmp_path / "k.key"
    key.write_text("ab" * 32 + "\n")
    key.chmod(0o644)
    ran = cli("run", case(), "--no-ledger", "--key-file", key, "--out", tmp_path / "out")
    assert ran.returncode == 2 and "mode 0644" in ran.stderr and "chmod 600" in ran.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_owned_by_another_user_is_refused(case, tmp_path):
    key = tmp_path / "k.key"
    key.write_text("ab" * 32 + "\n")
    key.chmod(0o600)
    os.chown(key, 65534, 65534)
    with pytest.raises(SpecError, match="owned by uid 65534"):
        run_release(case(), key_file=key, out_dir=tmp_path / "out")


def test_a_key_file_inside_the_output_tree_is_refused(case, tmp_path):
    with pytest.raises(SpecError, match="inside the output directory"):
        run_release(case(), key_file=tmp_path / "out" / "k.key", out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "k.key").exists()


def test_release_id_keys_with_output_dot_never_deletes_keys(case, tmp_path):
    spec = case(release_id="keys", output={"dir": "."})
    keys = spec.parent / "keys"
    keys.mkdir(mode=0o700)
    precious = keys / "other-release.key"
    precious.write_text("cd" * 32 + "\n")
    precious.chmod(0o600)
    ran = cli("run", spec, "--no-ledger", "--overwrite")
    assert ran.returncode == 2 and "inside the output directory" in ran.stderr
    assert precious.read_text() == "cd" * 32 + "\n"

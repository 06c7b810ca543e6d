"""The privacy-loss ledger: reservations, refusals (exit 3), free re-runs, concurrency, aborts."""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from fractions import Fraction

import pytest

from dprelease.accounting.errors import BudgetError, SpecError
from dprelease.accounting.ledger import COMMITTED, SCHEMA_VERSION, history, open_ledger, reserve, set_budget
from dprelease.pipelines import release as release_module
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True)


def test_monthly_series_stops_when_the_budget_is_spent(case, tmp_path):
    book = tmp_path / "ledger.sqlite"
    assert cli("ledger", "set-budget", "test-data", "--rho", 1, "--ledger", book).returncode == 0
    for month in (1, 2):
        spec = case(budget={"definition": "zcdp", "rho": "1/2"}, release_id=f"m{month}")
        ran = cli("run", spec, "--ledger", book, "--out", tmp_path / "out", "--key-file", tmp_path / f"{month}.key")
        assert ran.returncode == 0, ran.stderr
        manifest = json.loads((tmp_path / "out" / f"m{month}" / "manifest.json").read_text())
        assert manifest["ledger"]["spent_before"] == str(Fraction(month - 1, 2))
        assert manifest["ledger"]["spent_after"] == str(Fraction(month, 2))
        assert verify_release(tmp_path / "out" / f"m{month}", ledger=str(book)).ok
    spec = case(budget={"definition": "zcdp", "rho": "1/2"}, release_id="m3")
    refused = cli("run", spec, "--ledger", book, "--out", tmp_path / "m3", "--key-file", tmp_path / "3.key")
    assert refused.returncode == 3
    assert "needs 1/2 rho" in refused.stderr and "only 0" in refused.stderr and "set-budget" in refused.stderr
    assert not (tmp_path / "m3").exists() and not (tmp_path / "3.key").exists()
    _, rows = history(open_ledger(book), "test-data")
    assert [r.status for r in rows] == [COMMITTED, COMMITTED]
    shown = cli("ledger", "show", "test-data", "--ledger", book, "--delta", "1e-9")
    assert shown.returncode == 0 and "committed" in shown.stdout
    from dprelease.accounting.conversions import zcdp_to_epsilon
    assert f"ε = {zcdp_to_epsilon(1.0, 1e-9):.4g} at δ = 1e-09" in shown.stdout  # rho adds, then converts
    own = cli("ledger", "show", "test-data", "--ledger", book)  # each release's own δ (the spec's default, 1e-10)
    assert f"ε = {zcdp_to_epsilon(0.5, 1e-10):.4g} at δ = 1e-10" in own.stdout, own.stdout


def test_an_epsilon_delta_lifetime_budget_is_kept_in_rho_and_shown_at_its_delta(case, tmp_path):
    """Issue 30: a budget given as (ε, δ) is accepted (kept as the largest ρ whose conversion is (ε, δ)-DP) and
    the spend is shown as ε at that δ, decimals first."""
    from dprelease.accounting.conversions import zcdp_to_epsilon

    book = tmp_path / "ledger.sqlite"
    given = cli("ledger", "set-budget", "test-data", "--epsilon", "3", "--delta", "1e-9", "--ledger", book)
    assert given.returncode == 0 and "ε = 3 at δ = 1e-09" in given.stdout, given.stderr
    rows, _ = history(open_ledger(book), "test-data")
    rho = Fraction(rows[0].lifetime_budget)
    assert rows[0].unit == "rho" and zcdp_to_epsilon(float(rho), 1e-9) <= 3 < zcdp_to_epsilon(float(rho) * 1.001, 1e-9)
    ran = cli("run", case(budget={"definition": "approx", "epsilon": 1, "delta": 1e-9}), "--ledger", book,
              "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 0, ran.stderr
    shown = " ".join(cli("ledger", "list", "--ledger", book).stdout.split())
    assert "rho (zCDP)" in shown and "at δ = 1e-09" in shown
    wrong = cli("run", case(budget={"definition": "pure", "epsilon": 1}, release_id="p"), "--ledger", book,
                "--key-file", tmp_path / "p.key", "--out", tmp_path / "out")
    assert wrong.returncode == 3 and "give the spec a zcdp or approx budget" in " ".join(wrong.stderr.split())


def test_rerun_with_the_same_key_is_free_and_states_the_cost(case, tmp_path):
    spec = case(budget={"definition": "pure", "epsilon": 1})
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(3, 2))
    first = run_release(spec, ledger=book, key_file=tmp_path / "a.key", out_dir=tmp_path / "1")
    again = run_release(spec, ledger=book, key_file=tmp_path / "a.key", out_dir=tmp_path / "2")
    block = json.loads((again.release_dir / "manifest.json").read_text())["ledger"]
    assert (block["charged"], block["charged_by_this_run"], block["rerun_of_committed_release"]) == ("1", "0", True)
    assert (block["spent_before"], block["spent_after"]) == ("1", "1")
    assert (first.release_dir / "tables" / "pop.tract.csv").read_bytes() == \
        (again.release_dir / "tables" / "pop.tract.csv").read_bytes()
    for published in (first, again):  # both manifests are recorded in the ledger
        assert verify_release(published.release_dir, ledger=str(book)).ok
    with pytest.raises(BudgetError):
        run_release(case(budget={"definition": "pure", "epsilon": 1}, release_id="second"), ledger=book,
                    key_file=tmp_path / "b.key", out_dir=tmp_path / "3")


def test_a_release_id_already_live_is_refused_before_anything_is_reserved(case, tmp_path):
    """Item 10: of concurrent runs of one release id only one may hold it; a published id is never taken by
    another key (main charged a second run and then could not publish it, advising --overwrite)."""
    spec = case(budget={"definition": "pure", "epsilon": 1})
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    reserve(open_ledger(book), "test-data", "test-release", "another-key", "h", "epsilon", Fraction(1))
    refused = cli("run", spec, "--ledger", book, "--out", tmp_path / "out", "--key-file", tmp_path / "a.key")
    assert refused.returncode == 2 and "already reserved" in refused.stderr and "new release_id" in refused.stderr
    assert [r.status for r in history(open_ledger(book), "test-data")[1]] == ["reserved"]
    assert not (tmp_path / "a.key").exists() and not (tmp_path / "out" / "test-release").exists()
    run_release(case(release_id="other"), ledger=book, key_file=tmp_path / "b.key", out_dir=tmp_path / "out")
    again = cli("run", case(release_id="other"), "--ledger", book, "--out", tmp_path / "out", "--key-file",
                tmp_path / "c.key", "--overwrite")
    assert again.returncode == 2 and "already committed" in again.stderr
    assert [r.status for r in history(open_ledger(book), "test-data")[1]] == ["reserved", "committed"]


def test_unknown_dataset_is_refused(case, tmp_path):
    with pytest.raises(BudgetError, match="no budget in the ledger"):
        run_release(case(), ledger=tmp_path / "ledger.sqlite", key_file=tmp_path / "k.key")


def test_failure_after_reservation_releases_the_spend(case, tmp_path, monkeypatch):
    spec = case(budget={"definition": "pure", "epsilon": 1})
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(1))

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(release_module, "dump_manifest", explode)
    with pytest.raises(RuntimeError):
        run_release(spec, ledger=book, key_file=tmp_path / "k.key")
    monkeypatch.undo()
    _, rows = history(open_ledger(book), "test-data")
    assert [r.status for r in rows] == ["aborted"]
    assert run_release(spec, ledger=book, key_file=tmp_path / "k2.key").release_dir.exists()


def test_budget_changes_are_checked(tmp_path):
    book = open_ledger(tmp_path / "ledger.sqlite")
    set_budget(book, "d", "rho", Fraction(1))
    reserve(book, "d", "r", "k", "h", "rho", Fraction(1, 2))
    with pytest.raises(BudgetError, match="already spent"):
        set_budget(book, "d", "rho", Fraction(1, 4))
    with pytest.raises(SpecError, match="cannot switch"):
        set_budget(book, "d", "epsilon", Fraction(5))
    assert cli("ledger", "set-budget", "d", "--rho", -1, "--ledger", tmp_path / "ledger.sqlite").returncode == 2


def _race(path, release: str, barrier, results) -> None:
    book = open_ledger(path)
    barrier.wait()
    try:
        reserve(book, "d", release, release, "h", "rho", Fraction(1))
        results.put("reserved")
    except BudgetError:
        results.put("refused")


def test_two_processes_never_both_spend_the_last_budget(tmp_path):
    path = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(path), "d", "rho", Fraction(3, 2))
    context = multiprocessing.get_context("spawn")
    for round_ in range(3):
        set_budget(open_ledger(path), "d", "rho", Fraction(3, 2) + round_)
        barrier, results = context.Barrier(2), context.Queue()
        workers = [context.Process(target=_race, args=(path, f"{round_}-{i}", barrier, results)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        outcomes = sorted(results.get(timeout=10) for _ in workers)
        assert outcomes == ["refused", "reserved"]


def test_per_period_budget_caps_each_month_of_a_series(case, tmp_path):
    book = tmp_path / "ledger.sqlite"
    assert cli("ledger", "set-budget", "test-data", "--epsilon", 3, "--per-period", 1, "--ledger", book).returncode == 0
    november = case(period="2026-11", release_id="nov")
    ran = cli("run", november, "--ledger", book, "--out", tmp_path / "a", "--key-file", tmp_path / "a.key")
    assert ran.returncode == 0, ran.stderr
    ledger_block = json.loads((tmp_path / "a" / "nov" / "manifest.json").read_text())["ledger"]
    assert ledger_block["period"] == "2026-11"
    assert ledger_block["period_budget"] == {"per": "month", "budget": "1", "periods": [
        {"period": "2026-11", "spent_before": "0", "spent_after": "1"}]}
    again = cli("run", case(period="2026-11", release_id="nov-2"), "--ledger", book, "--out", tmp_path / "b",
                "--key-file", tmp_path / "b.key")
    assert again.returncode == 3 and "month 2026-11" in again.stderr and "per-month budget 1" in again.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.key").exists()
    unnamed = cli("run", case(release_id="c"), "--ledger", book, "--out", tmp_path / "c", "--key-file", tmp_path / "c.key")
    assert unnamed.returncode == 3 and "must name the period" in unnamed.stderr
    december = cli("run", case(period="2026-12", release_id="dec"), "--ledger", book, "--out", tmp_path / "d",
                   "--key-file", tmp_path / "d.key")
    assert december.returncode == 0, december.stderr
    assert json.loads((tmp_path / "d" / "dec" / "manifest.json").read_text())["ledger"]["spent_after"] == "2"
    with pytest.raises(SpecError, match="per-period"):
        set_budget(open_ledger(book), "test-data", "epsilon", Fraction(3), Fraction(4))


@pytest.mark.parametrize("spelling", ["2026-11-01", "2026-Q4", "2026"])
def test_a_period_spelled_otherwise_is_charged_to_the_same_month(case, tmp_path, spelling):
    """Item 9: main keyed period budgets by the literal text: 2026-11 was refused, 2026-11-01 published."""
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(30), Fraction(1), "month")
    assert run_release(case(period="2026-11", release_id="nov"), ledger=book, key_file=tmp_path / "a.key",
                       out_dir=tmp_path / "a").release_dir.exists()
    with pytest.raises(BudgetError, match="month 2026-11"):
        run_release(case(period=spelling, release_id="other"), ledger=book, key_file=tmp_path / "b.key",
                    out_dir=tmp_path / "b")


@pytest.mark.parametrize("bad", ["nov-2026", "2026-13", "2026-11-31", "2026-Q5", "26-11", "2026/11", "2026-11\n"])
def test_periods_outside_the_formats_are_refused_naming_the_field(case, tmp_path, bad):
    ran = cli("plan", case(period=bad))
    assert ran.returncode == 2 and f"period = {bad!r}" in ran.stderr and "YYYY-MM" in ran.stderr


def test_a_quarterly_budget_counts_every_release_that_overlaps_the_quarter(case, tmp_path):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(30), Fraction(2), "quarter")
    run_release(case(period="2026-10", release_id="oct"), ledger=book, key_file=tmp_path / "a.key", out_dir=tmp_path / "o")
    year = run_release(case(period="2026", release_id="year"), ledger=book, key_file=tmp_path / "b.key",
                       out_dir=tmp_path / "o")
    block = json.loads((year.release_dir / "manifest.json").read_text())["ledger"]["period_budget"]
    assert [(p["period"], p["spent_before"]) for p in block["periods"]] == [
        ("2026-Q1", "0"), ("2026-Q2", "0"), ("2026-Q3", "0"), ("2026-Q4", "1")]
    assert verify_release(year.release_dir, ledger=str(book)).ok
    with pytest.raises(BudgetError, match="quarter 2026-Q4"):
        run_release(case(period="2026-12-24", release_id="xmas"), ledger=book, key_file=tmp_path / "c.key",
                    out_dir=tmp_path / "o")


def test_a_version_1_ledger_is_migrated_in_place(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # the schema dprelease 0.1 created
        db.executescript("""
            CREATE TABLE schema_version (version INTEGER NOT NULL);
            INSERT INTO schema_version VALUES (1);
            CREATE TABLE datasets (dataset_id VARCHAR(128) PRIMARY KEY, unit VARCHAR(16) NOT NULL,
                                   lifetime_budget VARCHAR(64) NOT NULL, updated_at DATETIME NOT NULL);
            CREATE TABLE releases (id INTEGER PRIMARY KEY AUTOINCREMENT, dataset_id VARCHAR(128) NOT NULL,
                release_id VARCHAR(128) NOT NULL, key_id VARCHAR(32) NOT NULL, spec_sha256 VARCHAR(64) NOT NULL,
                manifest_sha256 VARCHAR(64), spend VARCHAR(64) NOT NULL, status VARCHAR(16) NOT NULL,
                reserved_at DATETIME NOT NULL, finished_at DATETIME);
            INSERT INTO datasets VALUES ('old', 'rho', '1', '2026-01-01 00:00:00');
            INSERT INTO releases (dataset_id, release_id, key_id, spec_sha256, spend, status, reserved_at)
                VALUES ('old', 'r1', 'k1', 'x', '3/4', 'committed', '2026-01-02 00:00:00');
        """)
    book = open_ledger(path)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    with pytest.raises(BudgetError, match="only 1/4"):
        reserve(book, "old", "r2", "k2", "y", "rho", Fraction(1, 2))
    assert reserve(book, "old", "r2", "k2", "y", "rho", Fraction(1, 4)).spent_before == Fraction(3, 4)


def test_the_default_ledger_lives_in_the_user_data_directory(tmp_path, monkeypatch):
    from dprelease.accounting.ledger import default_ledger_location

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_ledger_location() == tmp_path / "data" / "dprelease" / "ledger.sqlite"
    assert cli("ledger", "set-budget", "x", "--rho", 1).returncode == 0
    assert (tmp_path / "data" / "dprelease" / "ledger.sqlite").is_file()
    listed = cli("ledger", "list")
    assert listed.returncode == 0 and "x" in listed.stdout
    both = cli("run", "spec.yaml", "--no-ledger", "--ledger", tmp_path / "l.sqlite")
    assert both.returncode == 2 and "exclude each other" in both.stderr

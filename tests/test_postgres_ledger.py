"""The ledger on a real PostgreSQL server (127.0.0.1): first opens of a fresh database race safely,
two runs never both spend the last budget, and a password in the ledger URL is never published."""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from fractions import Fraction

from sqlalchemy import text

from dprelease.accounting.errors import BudgetError
from dprelease.accounting.ledger import SCHEMA_VERSION, history, open_ledger, reserve, set_budget



def _open(url, barrier, results) -> None:
    barrier.wait()
    try:
        open_ledger(url)
        results.put("opened")
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put(f"{type(error).__name__}: {error}")


def _reserve(url, release, barrier, results) -> None:
    book = open_ledger(url)
    barrier.wait()
    try:
        reserve(book, "d", release, release, "h", "rho", Fraction(1), input_fingerprint="f")
        results.put("reserved")
    except BudgetError:
        results.put("refused")


def _race(target, arguments: list[tuple]) -> list[str]:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(len(arguments)), context.Queue()
    workers = [context.Process(target=target, args=(*args, barrier, results)) for args in arguments]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    return sorted(results.get(timeout=10) for _ in workers)


def test_first_opens_of_a_fresh_database_race_safely(postgres):
    for _ in range(3):
        url = postgres.url(postgres.create_database())
        assert _race(_open, [(url,)] * 4) == ["opened"] * 4
        with open_ledger(url).connect() as connection:
            assert connection.execute(text("SELECT version FROM schema_version")).scalars().all() == [SCHEMA_VERSION]


def test_two_processes_never_both_spend_the_last_budget(postgres):
    url = postgres.url(postgres.create_database())
    for round_ in range(3):
        set_budget(open_ledger(url), "d", "rho", Fraction(3, 2) + round_)
        assert _race(_reserve, [(url, f"{round_}-{i}") for i in range(2)]) == ["refused", "reserved"]


def test_two_runs_race_for_the_last_budget_and_the_password_is_never_published(postgres, case, tmp_path):
    database = postgres.create_database()
    url = postgres.url(database, password="S3CRET-PASSWORD")  # trust authentication ignores it
    set_budget(open_ledger(url), "test-data", "epsilon", Fraction(3, 2))
    specs = [case(release_id=f"r{i}") for i in range(2)]  # one release id each: a shared id is refused (exit 2)
    runs = [subprocess.Popen([sys.executable, "-m", "dprelease.pipelines.cli", "run", str(specs[i]), "--ledger", url,
                              "--key-file", str(tmp_path / f"{i}.key"), "--out", str(tmp_path / f"out{i}")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outcomes = [(run.wait(120), run.stderr.read()) for run in runs]
    assert sorted(code for code, _ in outcomes) == [0, 3], outcomes
    winner = next(i for i, (code, _) in enumerate(outcomes) if code == 0)
    manifest_text = (tmp_path / f"out{winner}" / f"r{winner}" / "manifest.json").read_text()
    assert "S3CRET-PASSWORD" not in manifest_text
    invocation = json.loads(manifest_text)["provenance"]["invocation"]
    assert invocation["entry"] == "cli run" and invocation["options"]["ledger"] == "postgresql+psycopg"
    assert all("S3CRET" not in stderr for _, stderr in outcomes)
    assert [r.status for r in history(open_ledger(url), "test-data")[1]] == ["committed"]


def test_leases_of_a_migrated_ledger_hold_in_any_session_time_zone(postgres, monkeypatch):
    """A version-3 ledger migrated in place: its lease column must hold time zones (PostgreSQL's TIMESTAMP
    alone stores an aware UTC time as the session's local time: west of UTC, reconcile then aborted live
    runs at once, east of UTC it left dead runs' budget locked for hours)."""
    from sqlalchemy import create_engine

    from dprelease.accounting.ledger import RESERVED, reconcile

    url = postgres.url(postgres.create_database())
    with create_engine(url).begin() as connection:  # the schema dprelease wrote at version 3
        connection.execute(text("""
            CREATE TABLE schema_version (version INTEGER NOT NULL);
            INSERT INTO schema_version VALUES (3);
            CREATE TABLE datasets (dataset_id VARCHAR(128) PRIMARY KEY, unit VARCHAR(16) NOT NULL,
                lifetime_budget VARCHAR(64) NOT NULL, period_budget VARCHAR(64),
                updated_at TIMESTAMP WITH TIME ZONE NOT NULL);
            CREATE TABLE releases (id SERIAL PRIMARY KEY, dataset_id VARCHAR(128) NOT NULL REFERENCES datasets,
                release_id VARCHAR(128) NOT NULL, period VARCHAR(128), key_id VARCHAR(32) NOT NULL,
                spec_sha256 VARCHAR(64) NOT NULL, input_fingerprint VARCHAR(64), release_dir VARCHAR(4096),
                owner VARCHAR(256), manifest_sha256 VARCHAR(64), spend VARCHAR(64) NOT NULL,
                status VARCHAR(16) NOT NULL, reserved_at TIMESTAMP WITH TIME ZONE NOT NULL,
                finished_at TIMESTAMP WITH TIME ZONE);
        """))
    for zone in ("America/New_York", "Asia/Tokyo"):
        monkeypatch.setenv("PGTZ", zone)
        book = open_ledger(url)
        set_budget(book, f"d-{zone}", "rho", Fraction(5))
        reserve(book, f"d-{zone}", "r", f"k-{zone}", "s", "rho", Fraction(1), release_dir="/nowhere", owner="h:1.1")
        assert {s.action for s in reconcile(book, lambda row: None)} == {"left"}  # a fresh 300 s lease holds
        rows = history(book, f"d-{zone}")[1]
        assert [r.status for r in rows] == [RESERVED]

"""The privacy-loss ledger: per dataset, a lifetime budget and every release's spend, in a real
database through SQLAlchemy (a SQLite file by default, any SQLAlchemy URL such as PostgreSQL).

A dataset may also have a per-period budget for a release series (e.g. monthly): a release
that names its `period` is then charged against both the lifetime budget and that period's.

A run reserves its spend in one transaction before any noise is drawn (refusing, with nothing
written, if the budget would be exceeded), and commits the reservation after publishing or aborts
it on failure. Reservation is serialised per dataset: SQLite transactions start with BEGIN IMMEDIATE
(one writer at a time), other databases lock the dataset row (SELECT ... FOR UPDATE), so two
concurrent runs can never both spend the last budget.

Key reuse: a key belongs to one release. A re-run costs nothing only when dataset, release, key,
spec hash AND the input's keyed fingerprint all match a committed release (it then reproduces the
same release, bit for bit); a key already reserved or committed for anything else is refused
(KeyReuseError, exit 2), because two releases drawn with one key over different data or specs would
compose to more loss than either records.

Publishing and charging are one outcome: a run commits its charge before it renames the release into
place, and never aborts a reservation after that. A killed run leaves its row 'reserved';
`reconcile` releases it when its process is gone and its release is not published, and commits it
when the release is published.
Spends are exact fractions in the dataset's unit: epsilon (pure DP) or rho (zCDP; approximate-DP
releases are accounted in rho, which is how their noise is calibrated).
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from sqlalchemy import (Column, DateTime, ForeignKey, Integer, MetaData, String, Table, create_engine, event,
                        select)
from sqlalchemy.engine import Engine

from .errors import BudgetError, KeyReuseError, SpecError
from .redact import redact_url

SCHEMA_VERSION = 3
MIGRATIONS = {
    2: ["ALTER TABLE datasets ADD COLUMN period_budget VARCHAR(64)",
        "ALTER TABLE releases ADD COLUMN period VARCHAR(128)"],
    3: ["ALTER TABLE releases ADD COLUMN input_fingerprint VARCHAR(64)",
        "ALTER TABLE releases ADD COLUMN release_dir VARCHAR(4096)",
        "ALTER TABLE releases ADD COLUMN owner VARCHAR(256)"],
}
"""Statements that bring a ledger of version (n - 1) to version n, applied in order on open."""
metadata = MetaData()
schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))
datasets = Table(
    "datasets", metadata,
    Column("dataset_id", String(128), primary_key=True),
    Column("unit", String(16), nullable=False),
    Column("lifetime_budget", String(64), nullable=False),
    Column("period_budget", String(64)),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)
releases = Table(
    "releases", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("dataset_id", String(128), ForeignKey("datasets.dataset_id"), nullable=False),
    Column("release_id", String(128), nullable=False),
    Column("period", String(128)),
    Column("key_id", String(32), nullable=False),
    Column("spec_sha256", String(64), nullable=False),
    Column("input_fingerprint", String(64)),
    Column("release_dir", String(4096)),
    Column("owner", String(256)),
    Column("manifest_sha256", String(64)),
    Column("spend", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    Column("reserved_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
)
RESERVED, COMMITTED, ABORTED = "reserved", "committed", "aborted"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def default_ledger_location() -> Path:
    """The ledger used when none is named: ledger.sqlite in the user's data directory
    (on Linux $XDG_DATA_HOME/dprelease, else ~/.local/share/dprelease)."""
    import platformdirs

    return platformdirs.user_data_path("dprelease") / "ledger.sqlite"


def ledger_url(location: str | Path) -> str:
    """A SQLAlchemy URL for a path (SQLite file) or the URL itself."""
    text = str(location)
    return text if "://" in text else f"sqlite:///{Path(text).expanduser().resolve()}"


SCHEMA_LOCK = 0x64707265  # "dpre": the PostgreSQL advisory lock that serialises schema creation and migration


def open_ledger(location: str | Path) -> Engine:
    """Open (creating and migrating if needed) a ledger database. Schema creation is idempotent under
    concurrency: SQLite's BEGIN IMMEDIATE and PostgreSQL's advisory lock let one opener create it."""
    url = ledger_url(location)
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, future=True)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _autocommit_driver(dbapi_connection, record):  # let SQLAlchemy's begin issue BEGIN IMMEDIATE
            dbapi_connection.isolation_level = None
            dbapi_connection.execute("PRAGMA busy_timeout = 30000")

        @event.listens_for(engine, "begin")
        def _begin_immediate(connection):
            connection.exec_driver_sql("BEGIN IMMEDIATE")
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":  # first opens of a fresh database, one at a time
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")
        metadata.create_all(connection)
        version = connection.execute(select(schema_version.c.version)).scalar()
        if version is None:
            connection.execute(schema_version.insert().values(version=SCHEMA_VERSION))
        elif version > SCHEMA_VERSION:
            raise SpecError(f"--ledger {redact_url(str(location))}: schema version {version} is newer than this dprelease ({SCHEMA_VERSION})")
        else:
            _migrate(connection, version)
    return engine


def _migrate(connection, version: int) -> None:
    """Apply the migrations after `version`, in the caller's transaction (all or nothing)."""
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[target]:
            connection.exec_driver_sql(statement)
        connection.execute(schema_version.update().values(version=target))


@dataclass(frozen=True)
class Reservation:
    """A spend held for one run: committed after publish, aborted on failure."""

    row_id: int | None
    dataset_id: str
    unit: str
    spend: Fraction
    spent_before: Fraction
    lifetime_budget: Fraction
    rerun: bool
    period: str | None = None
    period_budget: Fraction | None = None
    period_spent_before: Fraction | None = None

    def record(self) -> dict:
        """The manifest's ledger block."""
        charged = Fraction(0) if self.rerun else self.spend
        record = {"dataset_id": self.dataset_id, "unit": self.unit, "lifetime_budget": str(self.lifetime_budget),
                  "spent_before": str(self.spent_before), "spent_after": str(self.spent_before + charged),
                  "charged": str(charged), "rerun_of_committed_release": self.rerun, "period": self.period,
                  "period_budget": None, "period_spent_before": None, "period_spent_after": None}
        if self.period_budget is not None:
            record.update({"period_budget": str(self.period_budget),
                           "period_spent_before": str(self.period_spent_before),
                           "period_spent_after": str(self.period_spent_before + charged)})
        return record


KEEP = object()
"""set_budget(per_period=KEEP): leave the dataset's per-period budget as it is."""


def set_budget(engine: Engine, dataset_id: str, unit: str, lifetime: Fraction, per_period=KEEP) -> None:
    """Create or update a dataset's lifetime budget and (Fraction, None = no limit, KEEP) per-period budget."""
    if unit not in ("epsilon", "rho"):
        raise SpecError(f"unit ({unit!r}) must be epsilon or rho")
    if lifetime <= 0:
        raise SpecError(f"lifetime budget ({lifetime}) must be > 0")
    if per_period is not KEEP and per_period is not None and not 0 < per_period <= lifetime:
        raise SpecError(f"--per-period = {per_period}: must be > 0 and at most the lifetime budget ({lifetime})")
    with engine.begin() as connection:
        row = connection.execute(select(datasets).where(datasets.c.dataset_id == dataset_id)).first()
        if row is not None and row.unit != unit:
            raise SpecError(f"dataset {dataset_id!r} is accounted in {row.unit}; cannot switch to {unit}")
        spent = _spent(connection, dataset_id)
        if lifetime < spent:
            raise BudgetError(f"dataset {dataset_id!r} has already spent {spent} {unit}; the budget cannot be {lifetime}")
        values = {"unit": unit, "lifetime_budget": str(lifetime), "updated_at": _now()}
        if per_period is not KEEP:
            values["period_budget"] = None if per_period is None else str(per_period)
        if row is None:
            connection.execute(datasets.insert().values(dataset_id=dataset_id, **values))
        else:
            connection.execute(datasets.update().where(datasets.c.dataset_id == dataset_id).values(**values))


def _spent(connection, dataset_id: str, period: str | None = None) -> Fraction:
    """Reserved + committed spend of the dataset (of one period when `period` is given)."""
    condition = (releases.c.dataset_id == dataset_id) & (releases.c.status.in_([RESERVED, COMMITTED]))
    if period is not None:
        condition &= releases.c.period == period
    spends = connection.execute(select(releases.c.spend).where(condition)).scalars()
    return sum((Fraction(s) for s in spends), Fraction(0))


@dataclass(frozen=True)
class ReleaseIdentity:
    """What a key is bound to: the release, its spec and its input (the input as a keyed fingerprint,
    internal: never published). Equal identities reproduce the same release with the same key."""

    dataset_id: str
    release_id: str
    key_id: str
    spec_sha256: str
    input_fingerprint: str | None = None

    def differences(self, row) -> list[str]:
        """The parts of a ledger row's identity (other than the key) that differ from this one."""
        pairs = (("dataset", row.dataset_id, self.dataset_id), ("release", row.release_id, self.release_id),
                 ("spec", row.spec_sha256, self.spec_sha256),
                 ("input", row.input_fingerprint, self.input_fingerprint))
        return [name for name, theirs, ours in pairs if theirs != ours or ours is None]


def _key_rows(connection, key_id: str) -> list:
    """Every live (reserved or committed) ledger row of a key, in any dataset."""
    return list(connection.execute(select(releases).where(
        (releases.c.key_id == key_id) & releases.c.status.in_([RESERVED, COMMITTED])).order_by(releases.c.id)))


def _check_key(identity: ReleaseIdentity, rows: list) -> bool:
    """True when a committed release of exactly this identity exists (a free re-run). Raises
    KeyReuseError (exit 2) when the key is live for anything else, and BudgetError (exit 3) when a run
    of this very identity holds a reservation (in progress, or killed: see `reconcile`)."""
    for row in rows:
        differs = identity.differences(row)
        if differs:
            raise KeyReuseError(
                f"--key-file: key {identity.key_id} is already {row.status} for release {row.release_id!r} of "
                f"dataset {row.dataset_id!r}, with a different {' and '.join(differs)}; a key serves one release, "
                "one spec and one input (reusing it would publish the difference of the true counts). Run without "
                "--key-file for a fresh key, or restore the committed spec and input to re-run that release")
    if any(row.status == RESERVED for row in rows):
        raise BudgetError(f"release {identity.release_id!r} with key {identity.key_id} is already reserved by "
                          "another run (in progress, or killed: `dprelease ledger reconcile` settles it)")
    return bool(rows)


def reserve(engine: Engine, dataset_id: str, release_id: str, key_id: str, spec_sha256: str,
            unit: str, spend: Fraction, period: str | None = None, *, input_fingerprint: str | None = None,
            release_dir: str | None = None, owner: str | None = None) -> Reservation:
    """Hold `spend` for a run, or raise BudgetError (exit 3) / KeyReuseError (exit 2) leaving the ledger
    unchanged. `owner` names the reserving process (host:pid:start) and `release_dir` where it will
    publish, so that `reconcile` can settle the row if the process dies."""
    identity = ReleaseIdentity(dataset_id, release_id, key_id, spec_sha256, input_fingerprint)
    with engine.begin() as connection:
        row = connection.execute(
            select(datasets).where(datasets.c.dataset_id == dataset_id).with_for_update()).first()
        if row is None:
            raise BudgetError(f"dataset {dataset_id!r} has no budget in the ledger; set one with "
                              f"`dprelease ledger set-budget {dataset_id} --{unit} VALUE`")
        if row.unit != unit:
            raise BudgetError(f"dataset {dataset_id!r} is accounted in {row.unit}, this release spends {unit}")
        lifetime = Fraction(row.lifetime_budget)
        spent = _spent(connection, dataset_id)
        done = _check_key(identity, _key_rows(connection, key_id))
        period_budget = Fraction(row.period_budget) if row.period_budget is not None else None
        if period_budget is not None and period is None:
            raise BudgetError(f"dataset {dataset_id!r} has a per-period budget ({period_budget} {unit}); the spec "
                              f"must name the period this release covers (period: e.g. 2026-11)")
        period_spent = _spent(connection, dataset_id, period) if period_budget is not None else None
        fields = dict(period=period, period_budget=period_budget, period_spent_before=period_spent)
        if done:
            return Reservation(None, dataset_id, unit, spend, spent, lifetime, rerun=True, **fields)
        if spent + spend > lifetime:
            raise BudgetError(
                f"dataset {dataset_id!r}: this release needs {spend} {unit} ({float(spend):.6g}) but only "
                f"{lifetime - spent} ({float(lifetime - spent):.6g}) of the lifetime {lifetime} remains; lower the "
                f"budget in the spec or raise it with `dprelease ledger set-budget`")
        if period_budget is not None and period_spent + spend > period_budget:
            raise BudgetError(
                f"dataset {dataset_id!r}, period {period!r}: this release needs {spend} {unit} "
                f"({float(spend):.6g}) but only {period_budget - period_spent} "
                f"({float(period_budget - period_spent):.6g}) of the per-period budget {period_budget} remains")
        result = connection.execute(releases.insert().values(
            dataset_id=dataset_id, release_id=release_id, period=period, key_id=key_id, spec_sha256=spec_sha256,
            input_fingerprint=input_fingerprint, release_dir=release_dir, owner=owner,
            spend=str(spend), status=RESERVED, reserved_at=_now()))
        return Reservation(result.inserted_primary_key[0], dataset_id, unit, spend, spent, lifetime, rerun=False,
                           **fields)


def _settle(connection, row_id: int, status: str, manifest_sha256: str | None) -> None:
    """Move a reserved row to `status`; rows already settled are left as they are."""
    connection.execute(releases.update().where((releases.c.id == row_id) & (releases.c.status == RESERVED)).values(
        status=status, manifest_sha256=manifest_sha256, finished_at=_now()))


def commit(engine: Engine, reservation: Reservation, manifest_sha256: str) -> None:
    """Charge the reservation for good (called before the release is renamed into place)."""
    if reservation.row_id is None:
        return
    with engine.begin() as connection:
        _settle(connection, reservation.row_id, COMMITTED, manifest_sha256)


def abort(engine: Engine, reservation: Reservation) -> None:
    """Release the reservation of a run that published nothing (never after the rename)."""
    if reservation.row_id is None:
        return
    with engine.begin() as connection:
        _settle(connection, reservation.row_id, ABORTED, None)


@dataclass(frozen=True)
class Settlement:
    """What `reconcile` did (or left) for one reserved row."""

    row_id: int
    dataset_id: str
    release_id: str
    action: str  # "committed", "aborted" or "left"
    reason: str


def reconcile(engine: Engine, owner_alive, published_manifest, dry_run: bool = False) -> list[Settlement]:
    """Settle reservations left by runs that died: for each reserved row whose owner process is gone
    (`owner_alive(owner)` is False), commit it when its release is published (`published_manifest(row)`
    gives that release's manifest SHA-256) and abort it otherwise. Rows of live runs, and rows that
    name no owner or release directory, are left as they are. `dry_run`: decide, change nothing."""
    done: list[Settlement] = []
    with engine.begin() as connection:
        rows = list(connection.execute(select(releases).where(releases.c.status == RESERVED).order_by(releases.c.id)))
        for row in rows:
            if row.owner is None or row.release_dir is None:
                done.append(Settlement(row.id, row.dataset_id, row.release_id, "left",
                                       "reserved by an older dprelease that recorded no owner or release directory"))
                continue
            alive = owner_alive(row.owner)
            if alive is None or alive:
                reason = "its run is still in progress" if alive else "its run is on another host"
                done.append(Settlement(row.id, row.dataset_id, row.release_id, "left", reason))
                continue
            manifest_sha256 = published_manifest(row)
            if manifest_sha256 is not None:
                if not dry_run:
                    _settle(connection, row.id, COMMITTED, manifest_sha256)
                done.append(Settlement(row.id, row.dataset_id, row.release_id, "committed",
                                       f"published at {row.release_dir}"))
            else:
                if not dry_run:
                    _settle(connection, row.id, ABORTED, None)
                done.append(Settlement(row.id, row.dataset_id, row.release_id, "aborted",
                                       "its run is gone and published nothing"))
    return done


def history(engine: Engine, dataset_id: str | None = None) -> tuple[list, list]:
    """(datasets rows, release rows), optionally for one dataset."""
    with engine.connect() as connection:
        query_d = select(datasets).order_by(datasets.c.dataset_id)
        query_r = select(releases).order_by(releases.c.id)
        if dataset_id:
            query_d = query_d.where(datasets.c.dataset_id == dataset_id)
            query_r = query_r.where(releases.c.dataset_id == dataset_id)
        return list(connection.execute(query_d)), list(connection.execute(query_r))

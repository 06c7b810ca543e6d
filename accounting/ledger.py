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
place, and never aborts a reservation after that. A reservation is held under a lease the run renews
(`LeaseKeeper`) and an owner token only the run knows: `commit` succeeds only while the row is still
'reserved' under that token, so a row that `reconcile` settled (its lease having expired) can never be
published afterwards. A killed run stops renewing; once its lease has expired `reconcile` commits the
row when its release is published and aborts it otherwise. Liveness never rests on host names or
process ids (a container in another PID namespace may share both).

A release id names one release of a dataset: a run is refused (exit 2) when the id is reserved or
committed with another key, spec or input. Every publication (the first, and each free re-run) records
its manifest's SHA-256, which `verify --ledger` checks a published manifest against.
Spends are exact fractions in the dataset's unit: epsilon (pure DP) or rho (zCDP; approximate-DP
releases are accounted in rho, which is how their noise is calibrated).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import os
import secrets
import threading
from typing import Callable

from sqlalchemy import (Column, DateTime, ForeignKey, Integer, MetaData, String, Table, create_engine, event,
                        select)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from .errors import BudgetError, DPReleaseError, KeyReuseError, SpecError
from .periods import UNITS as PERIOD_UNITS
from .periods import budget_periods, overlaps, parse_period
from .redact import shown

SCHEMA_VERSION = 6
MIGRATIONS = {
    2: ["ALTER TABLE datasets ADD COLUMN period_budget VARCHAR(64)",
        "ALTER TABLE releases ADD COLUMN period VARCHAR(128)"],
    3: ["ALTER TABLE releases ADD COLUMN input_fingerprint VARCHAR(64)",
        "ALTER TABLE releases ADD COLUMN release_dir VARCHAR(4096)",
        "ALTER TABLE releases ADD COLUMN owner VARCHAR(256)"],
    4: ["ALTER TABLE datasets ADD COLUMN period_unit VARCHAR(16)",
        "ALTER TABLE releases ADD COLUMN lease_expires_at TIMESTAMP WITH TIME ZONE",
        "ALTER TABLE releases ADD COLUMN owner_token VARCHAR(64)",
        "ALTER TABLE releases ADD COLUMN plan_sha256 VARCHAR(64)"],
    5: ["ALTER TABLE releases ADD COLUMN selection_sha256 VARCHAR(64)"],
    6: ["ALTER TABLE datasets ADD COLUMN delta VARCHAR(32)",
        "ALTER TABLE releases ADD COLUMN delta VARCHAR(32)",
        "ALTER TABLE releases ADD COLUMN measurements_sha256 VARCHAR(64)"],
}
"""(`TIMESTAMP WITH TIME ZONE`: PostgreSQL's TIMESTAMP alone would store an aware UTC time as the session's
local time.)"""
DEFAULT_LEASE_SECONDS = 300
LEASE_ENV = "DPRELEASE_LEASE_SECONDS"
RECONCILE_GRACE_SECONDS = 30
"""`reconcile` settles a reservation only this long after its lease expired (clocks of the hosts that
run releases and the one that reconciles must agree within it); env DPRELEASE_LEASE_GRACE_SECONDS."""
GRACE_ENV = "DPRELEASE_LEASE_GRACE_SECONDS"
"""Statements that bring a ledger of version (n - 1) to version n, applied in order on open."""
metadata = MetaData()
schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))
datasets = Table(
    "datasets", metadata,
    Column("dataset_id", String(128), primary_key=True),
    Column("unit", String(16), nullable=False),
    Column("lifetime_budget", String(64), nullable=False),
    Column("period_budget", String(64)),
    Column("period_unit", String(16)),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("delta", String(32)),
)
"""`delta`: for a dataset accounted in rho whose lifetime budget was given as (epsilon, delta), that delta (the
spend is shown as epsilon at it); None otherwise."""
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
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("owner_token", String(64)),
    Column("plan_sha256", String(64)),
    Column("selection_sha256", String(64)),
    Column("delta", String(32)),
    Column("measurements_sha256", String(64)),
)
"""`selection_sha256`: what a release's selections chose (the tables, in order), recorded by its first run; a
free re-run must choose exactly the same (`check_selection`)."""
publications = Table(
    "publications", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("release_row", Integer, ForeignKey("releases.id"), nullable=False),
    Column("manifest_sha256", String(64), nullable=False),
    Column("published_at", DateTime(timezone=True), nullable=False),
)
"""Every manifest a committed release was published with (its first run's, and each free re-run's)."""
RESERVED, COMMITTED, ABORTED = "reserved", "committed", "aborted"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _lease_end(seconds: float) -> dt.datetime:
    """When a lease taken or renewed now ends (to the microsecond: a lease of a few seconds stays exact)."""
    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)


def _utc(moment: dt.datetime | None) -> dt.datetime | None:
    """A stored time as an aware UTC datetime (SQLite returns naive ones)."""
    if moment is None:
        return None
    return moment.replace(tzinfo=dt.timezone.utc) if moment.tzinfo is None else moment


def lease_seconds() -> int:
    """How long a reservation's lease lasts unless renewed (env DPRELEASE_LEASE_SECONDS, default 300)."""
    return _seconds(LEASE_ENV, DEFAULT_LEASE_SECONDS, 1)


def grace_seconds() -> int:
    return _seconds(GRACE_ENV, RECONCILE_GRACE_SECONDS, 0)


def _seconds(name: str, default: int, least: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    if not text.isdigit() or not least <= int(text) <= 86_400:
        raise SpecError(f"{name} = {text!r}: must be a whole number of seconds in [{least}, 86400]")
    return int(text)


class LedgerError(DPReleaseError):
    """The ledger database cannot be reached or refused an operation. Exit code 1."""


def unreachable(location: str | Path, error: Exception) -> LedgerError:
    return LedgerError(f"ledger {shown(location)}: cannot be used ({type(error).__name__}); check that the "
                       "database exists and is reachable")


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


def open_ledger(location: str | Path, create: bool = True) -> Engine:
    """Open (creating and migrating if needed) a ledger database. Schema creation is idempotent under
    concurrency: SQLite's BEGIN IMMEDIATE and PostgreSQL's advisory lock let one opener create it.
    A database that cannot be reached is a LedgerError (one line, exit 1), never a traceback.
    `create=False` (read-only uses: verify, show): a SQLite file that does not exist is an error, not a new
    ledger."""
    url = ledger_url(location)
    if not create and url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        raise SpecError(f"--ledger = {shown(location)!r}: no such ledger file (a mistyped ledger would "
                        "look empty; `dprelease ledger set-budget` creates one)")
    try:
        return _open_ledger(location)
    except (ArgumentError, ImportError) as error:  # a URL SQLAlchemy cannot parse, or a driver not installed
        raise SpecError(f"--ledger = {shown(location)!r}: not a usable database URL ({type(error).__name__}"
                        "; a SQLite file path, or a SQLAlchemy URL whose driver is installed, e.g. "
                        "postgresql+psycopg://host/db with `pip install psycopg[binary]`)") from None
    except SQLAlchemyError as error:
        raise unreachable(location, error) from None
    except OSError as error:
        raise LedgerError(f"ledger {shown(location)}: cannot be used ({error.strerror})") from None


def _open_ledger(location: str | Path) -> Engine:
    url = ledger_url(location)
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # a new ledger file is the owner's only (key ids, fingerprints, hosts)
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            except FileExistsError:
                pass
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
            raise SpecError(f"--ledger {shown(location)}: schema version {version} is newer than this dprelease ({SCHEMA_VERSION})")
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
    """A spend held for one run (or, for a free re-run, the committed release it re-publishes): committed
    after staging, before the rename; aborted on failure. `owner_token` is the run's secret claim on its
    row; `periods` the budget periods charged, each with its spend before this run."""

    row_id: int | None
    dataset_id: str
    unit: str
    spend: Fraction
    spent_before: Fraction
    lifetime_budget: Fraction
    rerun: bool
    period: str | None = None
    period_budget: Fraction | None = None
    period_unit: str | None = None
    periods: tuple[tuple[str, Fraction], ...] = ()
    owner_token: str | None = None
    charged_early: bool = False
    """Committed before its release was staged (`charge_before_publication`): a failure no longer refunds it."""
    selection_sha256: str | None = None
    """A free re-run: what the committed release's selections chose (None: nothing recorded)."""

    @property
    def charged_by_this_run(self) -> Fraction:
        return Fraction(0) if self.rerun else self.spend

    def record(self) -> dict:
        """The manifest's ledger block (manifest version 3 and on): `charged` is what the release cost in the ledger
        (also when this run is a free re-run of it), `charged_by_this_run` what this run added."""
        added = self.charged_by_this_run
        record = {"dataset_id": self.dataset_id, "unit": self.unit, "lifetime_budget": str(self.lifetime_budget),
                  "spent_before": str(self.spent_before), "spent_after": str(self.spent_before + added),
                  "charged": str(self.spend), "charged_by_this_run": str(added),
                  "rerun_of_committed_release": self.rerun, "period": self.period, "period_budget": None}
        if self.period_budget is not None:
            record["period_budget"] = {
                "per": self.period_unit, "budget": str(self.period_budget),
                "periods": [{"period": name, "spent_before": str(before), "spent_after": str(before + added)}
                            for name, before in self.periods]}
        return record


KEEP = object()
"""set_budget(per_period=KEEP): leave the dataset's per-period budget as it is."""


def set_budget(engine: Engine, dataset_id: str, unit: str, lifetime: Fraction, per_period=KEEP,
               period_unit: str | None = None, delta: float | None = None) -> None:
    """Create or update a dataset's lifetime budget and (Fraction, None = no limit, KEEP) per-period budget,
    whose periods are `period_unit` long (year, quarter, month or day; default month). `delta`: the delta at
    which a rho budget was given as epsilon (`epsilon_budget`), kept to show spends as epsilon at it."""
    if unit not in ("epsilon", "rho"):
        raise SpecError(f"unit ({unit!r}) must be epsilon or rho")
    if lifetime <= 0:
        raise SpecError(f"lifetime budget ({lifetime}) must be > 0")
    if per_period is not KEEP and per_period is not None and not 0 < per_period <= lifetime:
        raise SpecError(f"--per-period = {per_period}: must be > 0 and at most the lifetime budget ({lifetime})")
    if period_unit is not None and period_unit not in PERIOD_UNITS:
        raise SpecError(f"--period-unit = {period_unit!r}: allowed: {', '.join(PERIOD_UNITS)}")
    with engine.begin() as connection:
        row = connection.execute(select(datasets).where(datasets.c.dataset_id == dataset_id)).first()
        if row is not None and row.unit != unit:
            raise SpecError(f"dataset {dataset_id!r} is accounted in {row.unit}; cannot switch to {unit}")
        spent = _spent(connection, dataset_id)
        if lifetime < spent:
            raise BudgetError(f"dataset {dataset_id!r} has already spent {spent} {unit}; the budget cannot be {lifetime}")
        values = {"unit": unit, "lifetime_budget": str(lifetime), "updated_at": _now(),
                  "delta": None if delta is None else repr(float(delta))}
        if per_period is not KEEP:
            values["period_budget"] = None if per_period is None else str(per_period)
            values["period_unit"] = None if per_period is None else (period_unit or "month")
        elif period_unit is not None:
            values["period_unit"] = period_unit
        if row is None:
            connection.execute(datasets.insert().values(dataset_id=dataset_id, **values))
        else:
            connection.execute(datasets.update().where(datasets.c.dataset_id == dataset_id).values(**values))


def _live_rows(connection, dataset_id: str) -> list:
    return list(connection.execute(select(releases).where(
        (releases.c.dataset_id == dataset_id) & releases.c.status.in_([RESERVED, COMMITTED]))))


def _spent(connection, dataset_id: str) -> Fraction:
    """Reserved + committed spend of the dataset."""
    return sum((Fraction(r.spend) for r in _live_rows(connection, dataset_id)), Fraction(0))


def _period_spent(rows: list, budget_period: str, period_unit: str) -> Fraction:
    """Reserved + committed spend charged to one budget period (every release whose period overlaps it)."""
    return sum((Fraction(r.spend) for r in rows if overlaps(r.period, budget_period, period_unit)), Fraction(0))


@dataclass(frozen=True)
class ReleaseIdentity:
    """What a key is bound to: the release, its spec and its input (the input as a keyed fingerprint,
    internal: never published). Equal identities reproduce the same release with the same key."""

    dataset_id: str
    release_id: str
    key_id: str
    spec_sha256: str
    input_fingerprint: str | None = None
    plan_sha256: str | None = None

    def differences(self, row) -> list[str]:
        """The parts of a ledger row's identity (other than the key) that differ from this one. A row
        written before plan fingerprints were recorded differs in its plan (a free re-run must be proven to
        draw the same noise onto the same cells)."""
        pairs = (("dataset", row.dataset_id, self.dataset_id), ("release", row.release_id, self.release_id),
                 ("spec", row.spec_sha256, self.spec_sha256),
                 ("input", row.input_fingerprint, self.input_fingerprint),
                 ("plan (domain files, calibration, noise version, a published marginals query's split: "
                  "optimal by default since manifest version 7, `strategy: direct` re-plans an older release; or a "
                  "`select: aim` query's rounds: over a capped model since version 8, annealed since version 9, so an "
                  "older aim release cannot be re-run free)", row.plan_sha256, self.plan_sha256))
        return [name for name, theirs, ours in pairs if theirs != ours or ours is None]


def _key_rows(connection, key_id: str) -> list:
    """Every live (reserved or committed) ledger row of a key, in any dataset."""
    return list(connection.execute(select(releases).where(
        (releases.c.key_id == key_id) & releases.c.status.in_([RESERVED, COMMITTED])).order_by(releases.c.id)))


def _check_key(identity: ReleaseIdentity, rows: list) -> object | None:
    """The committed row of exactly this identity (a free re-run), or None. Raises KeyReuseError (exit 2)
    when the key is live for anything else, and BudgetError (exit 3) when a run of this very identity
    holds a reservation (in progress, or killed: see `reconcile`)."""
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
                          "another run (in progress, or killed: `dprelease ledger reconcile` settles it once its "
                          "lease has expired)")
    committed = [row for row in rows if row.status == COMMITTED]
    return committed[0] if committed else None


def _check_release_id(identity: ReleaseIdentity, rows: list) -> None:
    """Refuse (exit 2) a release id that is reserved or committed in this dataset with another key: a release id
    names one release, and a second run under it would either be refused at publication after being charged
    or replace the first release."""
    for row in rows:
        if row.release_id == identity.release_id and row.key_id != identity.key_id:
            raise SpecError(
                f"release_id = {identity.release_id!r}: already {row.status} in dataset {identity.dataset_id!r} "
                f"(key {row.key_id}); a release id names one release, re-run free only with its own key, spec and "
                "input. Choose a new release_id")


def reserve(engine: Engine, dataset_id: str, release_id: str, key_id: str, spec_sha256: str,
            unit: str, spend: Fraction, period: str | None = None, *, input_fingerprint: str | None = None,
            release_dir: str | None = None, owner: str | None = None, plan_sha256: str | None = None,
            delta: float | None = None) -> Reservation:
    """Hold `spend` for a run, or raise BudgetError (exit 3) / KeyReuseError or SpecError (exit 2) leaving the
    ledger unchanged. The row is held under a fresh owner token and a lease (`lease_seconds`) that the run
    renews with a `LeaseKeeper`; `owner` (host:pid.start) and `release_dir` are recorded for people and for
    `reconcile`."""
    identity = ReleaseIdentity(dataset_id, release_id, key_id, spec_sha256, input_fingerprint, plan_sha256)
    with engine.begin() as connection:
        row = connection.execute(
            select(datasets).where(datasets.c.dataset_id == dataset_id).with_for_update()).first()
        if row is None:
            raise BudgetError(f"dataset {dataset_id!r} has no budget in the ledger; set one with "
                              f"`dprelease ledger set-budget {dataset_id} --{unit} VALUE`")
        if row.unit != unit:
            raise BudgetError(
                f"dataset {dataset_id!r} is accounted in {row.unit} ({'pure DP' if row.unit == 'epsilon' else 'zCDP'}), "
                f"but this release's budget spends {unit} ("
                + ("a pure budget" if unit == "epsilon" else "a zcdp or approx budget, accounted through zCDP")
                + "); a dataset is accounted in one unit: give the spec a "
                + ("zcdp or approx budget" if row.unit == "rho" else "pure budget")
                + " to charge this dataset, or account this series as another dataset_id")
        lifetime = Fraction(row.lifetime_budget)
        live = _live_rows(connection, dataset_id)
        spent = sum((Fraction(r.spend) for r in live), Fraction(0))
        committed = _check_key(identity, _key_rows(connection, key_id))
        _check_release_id(identity, live)
        period_budget = Fraction(row.period_budget) if row.period_budget is not None else None
        period_unit = (row.period_unit or "month") if period_budget is not None else None
        if period_budget is not None and period is None:
            raise BudgetError(f"dataset {dataset_id!r} has a per-period budget ({period_budget} {unit} per "
                              f"{period_unit}); the spec must name the period this release covers (period: e.g. "
                              "2026-11)")
        charged_periods: list[tuple[str, Fraction]] = []
        if period_budget is not None:
            try:
                names = budget_periods(parse_period(period), period_unit)
            except ValueError as error:
                raise SpecError(f"period = {period!r}: {error}") from None
            charged_periods = [(name, _period_spent(live, name, period_unit)) for name in names]
        fields = dict(period=period, period_budget=period_budget, period_unit=period_unit,
                      periods=tuple(charged_periods))
        if committed is not None:
            return Reservation(committed.id, dataset_id, unit, Fraction(committed.spend), spent, lifetime,
                               rerun=True, selection_sha256=committed.selection_sha256, **fields)
        if spent + spend > lifetime:
            raise BudgetError(
                f"dataset {dataset_id!r}: this release needs {spend} {unit} ({float(spend):.6g}) but only "
                f"{lifetime - spent} ({float(lifetime - spent):.6g}) of the lifetime {lifetime} remains; lower the "
                f"budget in the spec or raise it with `dprelease ledger set-budget`")
        for name, before in charged_periods:
            if before + spend > period_budget:
                raise BudgetError(
                    f"dataset {dataset_id!r}, {period_unit} {name} (release period {period!r}): this release needs "
                    f"{spend} {unit} ({float(spend):.6g}) but only {period_budget - before} "
                    f"({float(period_budget - before):.6g}) of the per-{period_unit} budget {period_budget} remains")
        token = secrets.token_hex(16)
        now = _now()
        result = connection.execute(releases.insert().values(
            dataset_id=dataset_id, release_id=release_id, period=period, key_id=key_id, spec_sha256=spec_sha256,
            input_fingerprint=input_fingerprint, release_dir=release_dir, owner=owner,
            spend=str(spend), status=RESERVED, reserved_at=now, owner_token=token, plan_sha256=plan_sha256,
            delta=None if delta is None else repr(float(delta)),
            lease_expires_at=_lease_end(lease_seconds())))
        return Reservation(result.inserted_primary_key[0], dataset_id, unit, spend, spent, lifetime, rerun=False,
                           owner_token=token, **fields)


def _held(reservation: Reservation):
    """The WHERE clause of a run's own, still reserved row."""
    return ((releases.c.id == reservation.row_id) & (releases.c.status == RESERVED)
            & (releases.c.owner_token == reservation.owner_token))


def _published(connection, row_id: int, manifest_sha256: str) -> None:
    connection.execute(publications.insert().values(release_row=row_id, manifest_sha256=manifest_sha256,
                                                    published_at=_now()))


def commit(engine: Engine, reservation: Reservation, manifest_sha256: str, measurements_sha256: str) -> None:
    """Charge the reservation for good and record the manifest about to be published (called before the
    rename), with the digest of its noisy measurements. Raises LedgerError, so that nothing is published, when
    the row is no longer this run's reserved row (settled by `reconcile` after the run's lease expired). A free
    re-run records only its manifest against the committed row, and only when its noisy measurements are
    exactly the committed release's (BudgetError otherwise, nothing published): the same key over the same
    input must reproduce them on any engine and version, and anything else would publish other noise for free
    (a discrepancy between engines, say, would publish the exact difference of their counts)."""
    with engine.begin() as connection:
        if reservation.rerun:
            _check_reproduced(connection, reservation, measurements_sha256)
        if reservation.charged_early:  # its first publication: the row shows it (ledger show, reconcile)
            connection.execute(releases.update().where((releases.c.id == reservation.row_id)
                                                       & releases.c.manifest_sha256.is_(None))
                               .values(manifest_sha256=manifest_sha256, measurements_sha256=measurements_sha256))
        if reservation.rerun or reservation.charged_early:
            _published(connection, reservation.row_id, manifest_sha256)
            return
        done = connection.execute(releases.update().where(_held(reservation)).values(
            status=COMMITTED, manifest_sha256=manifest_sha256, measurements_sha256=measurements_sha256,
            finished_at=_now(), lease_expires_at=None))
        if done.rowcount != 1:
            raise LedgerError(f"ledger: the reservation of release row {reservation.row_id} is no longer held by this "
                              "run (its lease expired and `dprelease ledger reconcile` settled it?); nothing is "
                              "published. Run the release again")
        _published(connection, reservation.row_id, manifest_sha256)


def _check_reproduced(connection, reservation: Reservation, measurements_sha256: str) -> None:
    """A free re-run publishes only the committed release's noisy measurements; a row committed before they
    were recorded records them now (its first re-run)."""
    row = connection.execute(select(releases.c.measurements_sha256).where(releases.c.id == reservation.row_id)).first()
    recorded = row.measurements_sha256 if row is not None else None
    if recorded is None:
        connection.execute(releases.update().where((releases.c.id == reservation.row_id)
                                                   & releases.c.measurements_sha256.is_(None))
                           .values(measurements_sha256=measurements_sha256))
    elif recorded != measurements_sha256:
        raise BudgetError(f"dataset {reservation.dataset_id!r}: this re-run's noisy measurements are not the "
                          "published release's (another engine or dprelease version counting otherwise?); a free "
                          "re-run must reproduce the release exactly. Nothing was published; run it as a new "
                          "release (new release_id and key) to spend budget on it")


def charge_before_publication(engine: Engine, reservation: Reservation) -> Reservation:
    """Charge the reservation for good now, before anything is staged: for a run whose later steps depend on
    an output already drawn from the data (a selection of tables), which must not be refunded by a failure or
    a kill that it could have caused. Publication then records its manifest only (as a free re-run's does);
    a re-run with the same key publishes at no further cost. Raises LedgerError when the row is no longer
    this run's reserved row."""
    if reservation.rerun or reservation.row_id is None:
        return reservation
    with engine.begin() as connection:
        done = connection.execute(releases.update().where(_held(reservation)).values(
            status=COMMITTED, finished_at=_now(), lease_expires_at=None))
    if done.rowcount != 1:
        raise LedgerError(f"ledger: the reservation of release row {reservation.row_id} is no longer held by this "
                          "run (its lease expired and `dprelease ledger reconcile` settled it?); run it again")
    return dataclasses.replace(reservation, charged_early=True)


def check_selection(engine: Engine, reservation: Reservation, selection_sha256: str) -> None:
    """Bind a release's selections to its ledger row. A first run records what it chose (before any measurement
    of the chosen tables is drawn); a free re-run must have chosen exactly that, or it is refused (BudgetError,
    exit 3) before anything is published: its choices come from floating-point model fits, so another machine or
    version could choose other tables, and publishing their measurements for free would spend budget nobody
    paid for. A committed release with no recorded selection is never re-run free with one."""
    if reservation.row_id is None:
        return
    if reservation.rerun:
        if reservation.selection_sha256 != selection_sha256:
            raise BudgetError(
                f"dataset {reservation.dataset_id!r}: this re-run chose other tables (or spent other budget units on "
                f"them) than the published release "
                + ("(none recorded for it)" if reservation.selection_sha256 is None else "")
                + "; a free re-run must reproduce the release it re-publishes (another machine or dprelease version "
                "can fit the models differently). Nothing was published; run it as a new release (new release_id "
                "and key) to spend budget on these tables")
        return
    with engine.begin() as connection:
        done = connection.execute(releases.update().where(
            (releases.c.id == reservation.row_id) & (releases.c.owner_token == reservation.owner_token)
            & releases.c.selection_sha256.is_(None)).values(selection_sha256=selection_sha256))
    if done.rowcount != 1:
        raise LedgerError(f"ledger: the selection of release row {reservation.row_id} could not be recorded (the "
                          "row is no longer this run's); nothing is published")


def abort(engine: Engine, reservation: Reservation) -> None:
    """Release the reservation of a run that published nothing (never after the rename, nor once charged)."""
    if reservation.rerun or reservation.charged_early or reservation.row_id is None:
        return
    with engine.begin() as connection:
        connection.execute(releases.update().where(_held(reservation)).values(
            status=ABORTED, finished_at=_now(), lease_expires_at=None))


def renew(engine: Engine, reservation: Reservation, seconds: int) -> bool:
    """Extend the run's lease by `seconds` from now; False when the row is no longer this run's reserved row."""
    with engine.begin() as connection:
        done = connection.execute(releases.update().where(_held(reservation)).values(
            lease_expires_at=_lease_end(seconds)))
    return done.rowcount == 1


class LeaseKeeper:
    """Renews a run's lease every fifth of its length in a background thread, while the run works. A renewal
    that fails (database unreachable) is retried at the next tick; the run's commit checks the row itself."""

    def __init__(self, engine: Engine, reservation: Reservation, seconds: int | None = None,
                 warn: Callable[[str], None] = lambda message: None):
        self._engine = engine
        self._reservation = reservation
        self._seconds = seconds or lease_seconds()
        self._warn = warn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dprelease-lease", daemon=True)
        self.lost = False

    def __enter__(self) -> "LeaseKeeper":
        if not self._reservation.rerun and self._reservation.row_id is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(max(self._seconds / 5, 0.2)):
            try:
                if not renew(self._engine, self._reservation, self._seconds):
                    self.lost = True
                    self._warn("ledger: this run's reservation is no longer held (settled by reconcile?); "
                               "the release will not be published")
                    return
            except SQLAlchemyError as error:
                self._warn(f"ledger: could not renew the reservation's lease ({type(error).__name__}); retrying")


@dataclass(frozen=True)
class Settlement:
    """What `reconcile` did (or left) for one reserved row."""

    row_id: int
    dataset_id: str
    release_id: str
    action: str  # "committed", "aborted" or "left"
    reason: str


def reconcile(engine: Engine, published_manifest, dry_run: bool = False, owner_alive=None,
              now: dt.datetime | None = None) -> list[Settlement]:
    """Settle reservations left by runs that died: a reserved row whose lease expired more than
    `grace_seconds()` ago is committed when its release is published (`published_manifest(row)`
    gives that release's manifest SHA-256) and aborted otherwise; a run that comes back afterwards cannot
    commit (its owner token no longer holds a reserved row), so nothing it stages is published. Rows
    under a live lease are left. Rows written before leases existed are settled only when
    `owner_alive(owner)` says their process on this host is gone. `dry_run`: decide, change nothing."""
    now = now or dt.datetime.now(dt.timezone.utc)
    grace = dt.timedelta(seconds=grace_seconds())
    done: list[Settlement] = []
    with engine.begin() as connection:
        rows = list(connection.execute(select(releases).where(releases.c.status == RESERVED).order_by(releases.c.id)))
        for row in rows:
            left = _still_held(row, now, grace, owner_alive)
            if left:
                done.append(Settlement(row.id, row.dataset_id, row.release_id, "left", left))
                continue
            manifest_sha256 = published_manifest(row) if row.release_dir else None
            action = COMMITTED if manifest_sha256 is not None else ABORTED
            if not dry_run:
                done_now = connection.execute(
                    releases.update().where((releases.c.id == row.id) & (releases.c.status == RESERVED))
                    .values(status=action, manifest_sha256=manifest_sha256, finished_at=_now(), lease_expires_at=None))
                if done_now.rowcount != 1:  # settled meanwhile by its own run
                    done.append(Settlement(row.id, row.dataset_id, row.release_id, "left",
                                           "settled by its own run meanwhile"))
                    continue
                if manifest_sha256 is not None:
                    _published(connection, row.id, manifest_sha256)
            reason = f"published at {row.release_dir}" if manifest_sha256 else "its run is gone and published nothing"
            done.append(Settlement(row.id, row.dataset_id, row.release_id, action, reason))
    return done


def _still_held(row, now: dt.datetime, grace: dt.timedelta, owner_alive) -> str | None:
    """Why a reserved row must be left alone, or None when its run is gone."""
    expires = _utc(row.lease_expires_at)
    if expires is not None:
        if now < expires + grace:
            return f"its run holds a lease until {expires.isoformat()} (+{grace.seconds} s grace)"
        return None
    if row.owner is None or row.release_dir is None:
        return "reserved by an older dprelease that recorded no owner or release directory"
    alive = owner_alive(row.owner) if owner_alive else None
    if alive is None:
        return "reserved by an older dprelease (no lease) on another host: reconcile it there"
    return "reserved by an older dprelease (no lease) whose process still runs" if alive else None


def publications_of(engine: Engine, row_id: int) -> list[str]:
    """The manifest SHA-256 of every publication of a committed release row."""
    with engine.connect() as connection:
        return list(connection.execute(select(publications.c.manifest_sha256)
                                       .where(publications.c.release_row == row_id)).scalars())


def release_rows(engine: Engine, dataset_id: str, release_id: str) -> list:
    """Every ledger row of one release id of a dataset (any status), oldest first."""
    with engine.connect() as connection:
        return list(connection.execute(select(releases).where(
            (releases.c.dataset_id == dataset_id) & (releases.c.release_id == release_id)).order_by(releases.c.id)))


def dataset_row(engine: Engine, dataset_id: str):
    with engine.connect() as connection:
        return connection.execute(select(datasets).where(datasets.c.dataset_id == dataset_id)).first()


def history(engine: Engine, dataset_id: str | None = None) -> tuple[list, list]:
    """(datasets rows, release rows), optionally for one dataset."""
    with engine.connect() as connection:
        query_d = select(datasets).order_by(datasets.c.dataset_id)
        query_r = select(releases).order_by(releases.c.id)
        if dataset_id:
            query_d = query_d.where(datasets.c.dataset_id == dataset_id)
            query_r = query_r.where(releases.c.dataset_id == dataset_id)
        return list(connection.execute(query_d)), list(connection.execute(query_r))

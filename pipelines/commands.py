"""The entry points besides a release's run, as Python functions: verify, report, synthesize, attack, demo data
and the ledger. The CLI is a shell over these (and over `api.Release`): one set of argument checks
(`arguments`), one storage layer (`storage`), and every exception that leaves them a DPReleaseError with its
exit-code class (`api.public_errors`).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator

from dprelease.accounting.errors import SpecError, VerificationError
from dprelease.accounting.redact import shown

from . import arguments
from .api import DEFAULT_LEDGER, ledger_location, public_errors
from .housekeeping import terminate_as_exit
from .storage import LocalCopy, check_output_file, downloaded, is_uri, write_atomically


@contextlib.contextmanager
def local_release(location: object, field: str = "RELEASE") -> Iterator[LocalCopy]:
    """A release named by a user, as a local directory: an object store's is downloaded to a private temporary
    copy for the duration (`storage.downloaded`); a local one is used in place."""
    checked = arguments.location(location, field, optional=False)
    if isinstance(checked, str):
        with downloaded(checked, field) as copy:
            yield copy
    else:
        yield LocalCopy(checked)


def _odd_objects(copy: LocalCopy) -> list[str]:
    return [f"object {shown(name)!r} under the release's prefix: not a plain name (a store reads it as another "
            "name); a release holds only its listed files" for name in copy.odd]


def _verified_only(copy: LocalCopy, location: object) -> None:
    """Refuse (as a failed verify does) a release whose store holds objects with odd names: commands that verify
    a release before they use it (synthesize, attack) use only releases that verify in full."""
    if copy.odd:
        raise VerificationError(f"{shown(location)}: does not verify ({'; '.join(_odd_objects(copy)[:3])}); run "
                                "`dprelease verify` on it")


def verify(location: str | Path, public_key: str | Path | None = None, ledger: str | Path | None = None,
           recompute: bool = False):
    """`dprelease verify`: every check of a release directory or object-store URI against its manifest (and a
    ledger, and the post-processing when `recompute`); returns the report (`report.ok`, `report.problems`).
    Mismatches are problems in the report, never exceptions; bad arguments raise SpecError (exit 2)."""
    from .verify import verify_release

    public_key = arguments.path(public_key, "public_key")
    ledger = ledger_location(ledger)
    recompute = arguments.flag(recompute, "recompute")
    with terminate_as_exit(), public_errors(stage="verify"), local_release(location) as copy:
        report = verify_release(copy.path, public_key, ledger=None if ledger is None else str(ledger),
                                recompute=recompute)
        for problem in _odd_objects(copy):
            report.problems.append(problem)
    return report


def _beside(location: str | Path, suffix: str) -> Path:
    """<release dir><suffix> in the release's parent directory (the release dir resolved first, so that a command
    run inside a release writes beside it, not into it); for a URI, <last name><suffix> in the current
    directory."""
    if isinstance(location, str) and is_uri(location):
        name = location.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        return Path.cwd() / f"{arguments.path(name, 'RELEASE').name}{suffix}"
    resolved = Path(location).resolve()
    return resolved.parent / f"{resolved.name}{suffix}"


def write_report(location: str | Path, out: str | Path | None = None, overwrite: bool = False,
                 public_key: str | Path | None = None, ledger: str | Path | None = None, recompute: bool = False):
    """`dprelease report`: a self-contained HTML report of a release (verified first); returns (its path, the
    verify report). `out`: default <release dir>.report.html beside the release (for a URI, in the current
    directory); never inside a release; an existing file only with `overwrite`."""
    from .report import render_report

    out = arguments.path(out, "out")
    overwrite = arguments.flag(overwrite, "overwrite")
    public_key = arguments.path(public_key, "public_key")
    ledger = ledger_location(ledger)
    recompute = arguments.flag(recompute, "recompute")
    with terminate_as_exit(), public_errors(stage="report"), local_release(location) as copy:
        target = check_output_file(out or _beside(location, ".report.html"), overwrite, "--out")
        page, report = render_report(copy.path, public_key, ledger, recompute, _odd_objects(copy))
        path = write_atomically(target, overwrite, lambda handle: handle.write(page))
    return path, report


@dataclass(frozen=True)
class SyntheticOutput:
    """What `synthesize` wrote: the records' Parquet file, its utility report, and the draw itself."""

    path: Path
    utility_path: Path
    synthetic: object


def synthesize(location: str | Path, out: str | Path | None = None, overwrite: bool = False,
               max_records: int = 100_000_000) -> SyntheticOutput:
    """`dprelease synthesize`: synthetic microdata drawn from a release's tables (post-processing only), written
    to `out` (default <release dir>.synthetic.parquet beside it) and its utility report beside that."""
    from .synthesize import synthesize as draw
    from .synthesize import write_synthetic

    out = arguments.path(out, "out")
    overwrite = arguments.flag(overwrite, "overwrite")
    max_records = arguments.count(max_records, "max_records", optional=False)
    with terminate_as_exit(), public_errors(stage="synthesize"), local_release(location) as copy:
        _verified_only(copy, location)
        target = check_output_file(out or _beside(location, ".synthetic.parquet"), overwrite, "--out")
        report_path = check_output_file(target.with_name(target.name + ".utility.json"), overwrite, "--out")
        synthetic = draw(copy.path, max_records=max_records, shown_as=shown(location))
        path = write_atomically(target, overwrite, lambda handle: write_synthetic(synthetic, handle))
        utility = json.dumps({"release": shown(location), "synthetic": str(path), "tables": synthetic.utility},
                             indent=2).encode("utf-8")
        write_atomically(report_path, overwrite, lambda handle: handle.write(utility))
    return SyntheticOutput(path, report_path, synthetic)


def attack(location: str | Path, data: str | Path, internal_dir: str | Path, max_units: int | None = None,
           time_limit: float = 10.0, progress: Callable[[int, int], None] = lambda done, total: None) -> Path:
    """`dprelease attack`: the reconstruction-risk check of a release against its confidential input; the
    (confidential) result is written to `internal_dir`, a private directory, and its path returned."""
    from .attack import attack as reconstruct

    data = arguments.location(data, "data", optional=False)
    internal = arguments.path(internal_dir, "internal_dir", optional=False)
    max_units = arguments.count(max_units, "max_units")
    time_limit = arguments.number(time_limit, "time_limit", 0.1, 86_400)
    with terminate_as_exit(), public_errors(internal, "attack"), local_release(location) as copy:
        _verified_only(copy, location)
        return reconstruct(copy.path, str(data), internal, max_units, time_limit, progress=progress)


def demo_data(rows: int, out: str | Path, overwrite: bool = False, seed: int = 1, dirty_rate: float = 0.001,
              states: int | None = None, counties: int | None = None, tracts: int | None = None,
              blocks: int | None = None) -> tuple[Path, Path]:
    """`dprelease demo-data`: a synthetic census-like person file (`out`: a .parquet or .csv file, or a directory
    for persons.parquet) and its geography domain file geography.txt beside it; existing files are replaced only
    with `overwrite`, never inside a release. Returns (data file, domain file)."""
    from dprelease.examples.generator import country_geography, write_demo_data

    rows = arguments.count(rows, "rows", 0, 10**10, optional=False)
    out = arguments.path(out, "out", optional=False)
    overwrite = arguments.flag(overwrite, "overwrite")
    seed = arguments.count(seed, "seed", 0, 2**63 - 1, optional=False)
    dirty_rate = arguments.number(dirty_rate, "dirty_rate", 0, 1)
    sizes = {"states": arguments.count(states, "states", 1, 99), "counties": arguments.count(counties, "counties"),
             "tracts": arguments.count(tracts, "tracts"), "blocks": arguments.count(blocks, "blocks")}
    geography = None
    if any(v is not None for v in sizes.values()):
        missing = [f"--{name}" for name in ("states", "counties", "tracts") if sizes[name] is None]
        if missing:
            raise SpecError(f"{', '.join(missing)}: needed with the other geography sizes")
        if not sizes["states"] <= sizes["counties"] <= sizes["tracts"] <= (sizes["blocks"] or sizes["tracts"]):
            raise SpecError(f"--states {sizes['states']} --counties {sizes['counties']} --tracts {sizes['tracts']} "
                            f"--blocks {sizes['blocks']}: each level needs at least as many units as the level above")
        try:
            geography = country_geography(sizes["states"], sizes["counties"], sizes["tracts"], sizes["blocks"] or 0)
        except ValueError as error:
            raise SpecError(f"geography sizes: {error}") from None
    data_file = out if out.suffix in (".parquet", ".csv") else out / "persons.parquet"
    with terminate_as_exit(), public_errors(stage="demo-data"):
        data_target = check_output_file(data_file, overwrite, "--out")
        domain_target = check_output_file(data_target.parent / "geography.txt", overwrite, "--out")
        return write_demo_data(data_target, domain_target, rows, overwrite, seed=seed, dirty_rate=dirty_rate,
                               geography=geography)


class Ledger:
    """`dprelease ledger`: the privacy-loss ledger of `location` (a SQLite file, a SQLAlchemy URL, or the default
    ledger). Reading never creates a ledger: a missing SQLite file is a SpecError (exit 2), so a mistyped ledger
    never looks like an empty one; `set_budget` creates it."""

    def __init__(self, location: str | Path = DEFAULT_LEDGER):
        self.location = ledger_location(location)
        if self.location is None:
            raise SpecError("ledger: a SQLite file, a SQLAlchemy URL or the default ledger")

    def _open(self, create: bool):
        from dprelease.accounting.ledger import open_ledger

        return open_ledger(self.location, create=create)

    def set_budget(self, dataset: str, *, epsilon=None, rho=None, delta: float | None = None, per_period=None,
                   period_unit: str | None = None) -> tuple[str, Fraction, object]:
        """Create or change a dataset's lifetime budget: exactly one of `epsilon` (pure DP; with `delta`, an
        (epsilon, delta) budget for zCDP and approximate releases, kept as the largest rho whose conversion is
        (epsilon, delta)-DP) or `rho` (zCDP), each a number or an exact fraction as text; and its per-period budget
        (`per_period`: an amount in the same terms, or 'none' to remove it; kept when None). Returns (unit, the
        lifetime amount in that unit, the per-period budget set or KEEP)."""
        from dprelease.accounting.conversions import approx_to_zcdp
        from dprelease.accounting.ledger import KEEP, set_budget

        dataset = _dataset_id(dataset)
        if (epsilon is None) == (rho is None):
            raise SpecError("ledger set-budget: give exactly one of --epsilon or --rho")
        if delta is not None and epsilon is None:
            raise SpecError("--delta: goes with --epsilon (an (epsilon, delta) budget); a --rho budget has none")
        if delta is not None:
            delta = arguments.number(delta, "delta", 1e-100, 0.5)
        unit, value = ("epsilon", epsilon) if epsilon is not None else ("rho", rho)
        amount = _amount(value, f"--{unit}")
        period = KEEP
        if per_period is not None:
            period = None if str(per_period).lower() == "none" else _amount(per_period, "--per-period")
        if delta is not None:  # (epsilon, delta): accounted in rho, as the releases it funds are
            unit, amount = "rho", approx_to_zcdp(amount, delta)
            period = period if period in (None, KEEP) else approx_to_zcdp(period, delta)
        period_unit = arguments.choice(period_unit, "period_unit", ("year", "quarter", "month", "day"))
        with public_errors(stage="ledger set-budget"):
            set_budget(self._open(create=True), dataset, unit, amount, period, period_unit, delta)
        return unit, amount, period

    def history(self, dataset: str | None = None) -> tuple[list, list]:
        """(dataset rows, release rows), of one dataset when named (SpecError when it has none)."""
        from dprelease.accounting.ledger import history

        dataset = None if dataset is None else _dataset_id(dataset)
        with public_errors(stage="ledger"):
            rows, releases = history(self._open(create=False), dataset)
        if dataset and not rows:
            raise SpecError(f"ledger: no dataset {shown(dataset)!r}")
        return rows, releases

    def reconcile(self, dry_run: bool = False) -> list:
        """Settle reservations left 'reserved' by runs that were killed (see `accounting.ledger.reconcile`)."""
        from dprelease.accounting.ledger import reconcile

        from .housekeeping import owner_alive
        from .verify import published_manifest_sha256

        dry_run = arguments.flag(dry_run, "dry_run")
        with public_errors(stage="ledger reconcile"):
            return reconcile(self._open(create=False), published_manifest_sha256, dry_run, owner_alive)


def _amount(value: object, name: str) -> Fraction:
    """A budget amount: a positive number or exact fraction as text."""
    from dprelease.accounting.rationals import parse_rational

    try:
        return Fraction(parse_rational(value))
    except (ValueError, TypeError) as error:
        raise SpecError(f"{name} = {shown(value)!r}: {error}") from None


def _dataset_id(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 128:
        raise SpecError(f"dataset = {shown(value)!r}: allowed: a dataset id (text, at most 128 characters)")
    return value

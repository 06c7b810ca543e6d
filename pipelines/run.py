"""`dprelease run`: spec -> plan -> engine -> post-processing -> published release."""
from __future__ import annotations

import datetime as dt
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dprelease.accounting.errors import SpecError
from dprelease.accounting.ledger import finish, open_ledger, reserve
from dprelease.accounting.signing import load_private_key
from dprelease.transforms.csprng import ReleaseKey

from .engines.base import Engine, ProgressHook, no_progress
from .engines.embedded import EmbeddedEngine
from .plan import Plan, build_plan
from .postprocessing import post_process
from .manifest import file_stamp, sha256_file
from .release import write_release
from .source import InputSource, open_input
from .spec import load_spec
from .validation import (StrictValidationError, SuiteRunner, check_schema, expectations_from_spec, manifest_record,
                         write_internal_report)


LOG = logging.getLogger("dprelease")
"""Messages carry public facts only (spec, plan, file names, stages): never counts or values."""


@dataclass(frozen=True)
class RunResult:
    release_dir: Path
    key_file: Path
    key_reused: bool
    plan: Plan


def creation_time() -> str:
    """UTC time of the run's start, or SOURCE_DATE_EPOCH (reproducible builds) when set."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc) if epoch else dt.datetime.now(dt.timezone.utc)
    return moment.replace(microsecond=0).isoformat()


def resolve_key(key_file: Path | None, spec_dir: Path, release_id: str, created_at: str) -> tuple[ReleaseKey, Path, bool]:
    """Load `key_file` if it exists; else draw a fresh key from the OS, to be saved there
    (default: <spec dir>/keys/<release id>-<time>.key, outside any release directory) by the caller
    once the run is allowed to go ahead."""
    if key_file is None:
        key_file = spec_dir / "keys" / f"{release_id}-{file_stamp(created_at)}-{os.urandom(3).hex()}.key"
    key_file = Path(key_file)
    if key_file.exists():
        try:
            return ReleaseKey.load(key_file), key_file, True
        except ValueError as error:
            raise SpecError(f"--key-file = {str(key_file)!r}: {error}") from None
    return ReleaseKey.generate(), key_file, False


ENGINES = ("embedded", "spark", "beam")


def _reserve(ledger: str | Path | None, plan: Plan, key: ReleaseKey):
    """Reserve the release's composed loss in the ledger (before any noise is drawn), if one is used."""
    if ledger is None:
        LOG.warning("no ledger: this release's spend is not accounted against the dataset's budget")
        return None, None
    book = open_ledger(ledger)
    totals = plan.totals
    unit, spend = ("epsilon", totals.pure_epsilon) if totals.pure_epsilon is not None else ("rho", totals.rho)
    spec = plan.spec
    reservation = reserve(book, spec.dataset_id, spec.release_id, key.key_id(), spec.spec_hash(), unit, spend,
                          spec.period)
    LOG.info("ledger: reserved %s %s of dataset %s", "nothing (re-run)" if reservation.rerun else spend, unit,
             spec.dataset_id)
    return book, reservation


def make_engine(name: str, workers: int | None, master: str | None = None, runner: str | None = None,
                beam_options: list[str] | None = None) -> Engine:
    if name != "beam" and (runner or beam_options):
        raise SpecError(f"--runner / pipeline options: only the beam engine takes them (engine is {name})")
    if name == "embedded":
        if master:
            raise SpecError(f"--master = {master!r}: only the spark engine takes a master URL")
        return EmbeddedEngine(workers=workers)
    if name == "spark":
        from .engines.spark import SparkEngine

        return SparkEngine(master=master)
    if name == "beam":
        if master:
            raise SpecError(f"--master = {master!r}: only the spark engine takes a master URL; "
                            "pass Beam runner options after --")
        from .engines.beam import BeamEngine

        return BeamEngine(runner=runner, options=list(beam_options or []), workers=workers)
    raise SpecError(f"--engine = {name!r}: allowed: {', '.join(ENGINES)}")


@dataclass
class InputValidation:
    """A validation asked for with --internal-dir: the suite, and its schema-level results (public)."""

    suite: SuiteRunner
    schema_results: dict
    internal_dir: Path
    strict: bool


def check_input_schema(plan: Plan, source: InputSource, internal_dir: Path | None,
                       strict: bool) -> InputValidation | None:
    """When validation is asked for (internal_dir), build the spec's suite and run its schema-level
    expectations: a failure is public and raises InputSchemaError (exit 2) before any budget is
    reserved or any value is read."""
    if internal_dir is None:
        if strict:
            raise SpecError("--strict: needs --internal-dir (where the confidential validation report goes)")
        return None
    suite = SuiteRunner(expectations_from_spec(plan))
    schema_results = check_schema(suite, source.dataset.schema, plan)
    LOG.info("input validation: schema-level expectations met")
    return InputValidation(suite, schema_results, Path(internal_dir), strict)


def _value_report(plan: Plan, engine: Engine, source: InputSource, validation: InputValidation,
                  created_at: str) -> tuple[bool, Path]:
    """Run the value-level expectations with the engine and write the (confidential) report to the
    internal directory. Returns (whether every expectation held, the report's path): internal only."""
    LOG.info("input validation: checking values (%s engine)", engine.name)
    outcome = engine.validate_input(plan, source, validation.suite)
    report = write_internal_report(validation.internal_dir, plan, validation.suite, validation.schema_results,
                                   outcome, engine.name, source.files(), created_at)
    LOG.info("input validation: report written to the internal directory %s", validation.internal_dir)
    return outcome.success, report


def check_input_values(plan: Plan, engine: Engine, source: InputSource, validation: InputValidation,
                       created_at: str) -> dict:
    """Validate the values (report to the internal directory only). With strict, a failure aborts
    (exit 1; data-dependent, internal). Returns the manifest's public block (suite hash and
    policies, no results)."""
    passed, report = _value_report(plan, engine, source, validation, created_at)
    if validation.strict and not passed:
        raise StrictValidationError(f"--strict: the input failed value-level expectations; see {report}")
    return manifest_record(plan)


def validate_only(spec_path: Path, internal_dir: Path, *, input_path: str | None = None, engine: str | None = None,
                  master: str | None = None) -> Path:
    """Validate an input against the spec's suite without releasing anything (no key, no budget, no
    noise): schema failures raise (exit 2); the value-level report goes to `internal_dir`."""
    created_at = creation_time()
    spec, spec_dir = load_spec(spec_path)
    plan = build_plan(spec, spec_dir)
    engine_ = make_engine(engine or spec.engine, None, master)
    source = open_input(plan, spec_dir, input_path)
    validation = check_input_schema(plan, source, internal_dir, strict=False)
    return _value_report(plan, engine_, source, validation, created_at)[1]


def run_release(
    spec_path: Path, *, key_file: Path | None = None, out_dir: Path | None = None, input_path: str | None = None,
    engine: str | None = None, workers: int | None = None, overwrite: bool = False, master: str | None = None,
    ledger: str | Path | None = None, sign_key: Path | None = None, progress: ProgressHook = no_progress,
    command_line: list[str] | None = None, internal_dir: Path | None = None, strict: bool = False,
    runner: str | None = None, beam_options: list[str] | None = None,
) -> RunResult:
    """Run a release end to end. Everything that can abort on public grounds (spec, domain files,
    input schema, existing release) is checked before the key is drawn or any noise is sampled,
    and before the ledger reserves any budget."""
    created_at = creation_time()
    spec, spec_dir = load_spec(spec_path)
    plan = build_plan(spec, spec_dir)
    LOG.info("planned release %s: %d tables, %d cells, %s budget", spec.release_id, len(plan.tables),
             sum(t.n_cells for t in plan.tables), spec.budget.definition)
    root = Path(out_dir) if out_dir else spec_dir / spec.output.dir
    final_dir = root / spec.release_id
    if internal_dir is not None and Path(internal_dir).resolve().is_relative_to(root.resolve()):
        raise SpecError(f"--internal-dir = {str(internal_dir)!r}: must not be inside the output directory {root} "
                        "(the validation report is confidential)")
    if final_dir.exists() and not overwrite:
        raise SpecError(f"output: release directory {final_dir} already exists; pass --overwrite to replace it")
    engine_ = make_engine(engine or spec.engine, workers, master, runner, beam_options)
    signer = load_private_key(sign_key) if sign_key else None
    source = open_input(plan, spec_dir, input_path)
    LOG.info("input: %d %s file(s); engine %s", len(source.files()), source.format, engine_.name)
    validation = check_input_schema(plan, source, internal_dir, strict)
    key, key_path, reused = resolve_key(key_file, spec_dir, spec.release_id, created_at)
    book, reservation = _reserve(ledger, plan, key)
    LOG.info("key %s (%s)", key.key_id(), "reused" if reused else "new")
    try:
        validation_record = check_input_values(plan, engine_, source, validation, created_at) if validation else None
        if not reused:
            key.save(key_path)
        noisy = engine_.noisy_measurements(plan, source, key, progress)
        LOG.info("noisy measurements drawn for %d tables", len(plan.tables))
        published = post_process(plan, noisy)
        LOG.info("post-processed %d tables", len(plan.tables))
        write_release(plan, noisy, published, final_dir, engine=engine_.name, key_id=key.key_id(),
                      created_at=created_at, command_line=command_line or sys.argv, overwrite=overwrite,
                      progress=progress, ledger=reservation.record() if reservation else None, sign_key=signer,
                      input_validation=validation_record)
    except BaseException:
        if reservation:
            finish(book, reservation, None)
        raise
    if reservation:
        finish(book, reservation, sha256_file(final_dir / "manifest.json"))
    LOG.info("published %s", final_dir)
    return RunResult(final_dir, key_path, reused, plan)

"""`dprelease run`: spec -> plan -> engine -> post-processing -> published release."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dprelease.accounting.errors import DPReleaseError, PublishError, SpecError
from dprelease.accounting.ledger import (LeaseKeeper, abort, charge_before_publication, check_selection, commit,
                                         open_ledger, reserve)
from dprelease.accounting.redact import shown
from dprelease.accounting.signing import MAX_KEY_BYTES, load_private_key
from dprelease.transforms.csprng import ReleaseKey

from .engines.base import Engine, ProgressHook, no_progress
from .engines.embedded import EmbeddedEngine, spill_prefix
from .housekeeping import (RUN_TEMPORARY_PREFIXES, input_copy_prefix, owner, process_alive, raise_if_terminated,
                           remove_stale, run_temporary_directory, shielded, store_leftover_tag, terminate_as_exit)
from .keys import check_key_location, default_key_path, load_or_generate
from .manifest import plan_fingerprint, selection_fingerprint
from .limits import check_plan_limits
from .plan import Plan, build_plan
from .debiased import DEBIASED_DIR
from .layout import MEASUREMENTS_DIR, TABLES_DIR, Layout
from .postprocessing import estimation_path, post_process, unit_tree
from .provenance import Invocation, run_invocation
from .release import (StagedRelease, check_removed, check_reported_parts, check_staged_files, check_target,
                      expected_part_files, finish_release, new_staging, publish, replaced_prefix, stage_release,
                      staging_prefix, store_staging_prefix)
from .coding_check import coding_warnings, files_read
from .selection import check_engine_selects, select_tables
from .source import InputSource, open_input, open_memory_input
from .storage import (MANIFEST, RemoteRelease, StagedPartsLeft, check_remote_staged, check_remote_target, inside,
                      is_uri, new_remote_staging, private_directory, read_named, release_under, remove_stale_remote,
                      upload_release)
from .storage.objects import copy_bounded
from .spec import ReleaseSpec, load_spec
from .validation import (StrictValidationError, SuiteRunner, check_schema, expectations_from_spec, manifest_record,
                         write_internal_report)


LOG = logging.getLogger("dprelease")
"""Messages carry public facts only (spec, plan, file names, stages): never counts or values."""


@dataclass(frozen=True)
class RunResult:
    release_dir: Path | str
    """The published release: a local directory, or its URI in an object store (`pipelines.storage.objects`)."""
    key_file: Path
    key_reused: bool
    plan: Plan
    coding_warnings: list[str] = field(default_factory=list)
    """Dimensions whose (other) cells hold a large share of a published table (`coding_check`; public)."""


def creation_time() -> str:
    """UTC time of the run's start, or SOURCE_DATE_EPOCH (reproducible builds) when set."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc) if epoch else dt.datetime.now(dt.timezone.utc)
    return moment.replace(microsecond=0).isoformat()


ENGINES = ("embedded", "spark", "beam")


def _reserve(book, plan: Plan, key: ReleaseKey, input_fingerprint: str, location: str):
    """Reserve the release's composed loss in the ledger `book` (before any noise is drawn), if one is used;
    the reservation binds the key to this release, spec and input (see accounting.ledger)."""
    if book is None:
        LOG.warning("no ledger: this release's spend is not accounted against the dataset's budget")
        return None
    unit, spend = plan.ledger_spend()
    spec = plan.spec
    reservation = reserve(book, spec.dataset_id, spec.release_id, key.key_id(), spec.spec_hash(), unit, spend,
                          spec.period, input_fingerprint=input_fingerprint, release_dir=location,
                          owner=owner(), plan_sha256=plan_fingerprint(plan),
                          delta=None if plan.definition == "pure" else plan.delta)
    LOG.info("ledger: reserved %s %s of dataset %s", "nothing (re-run)" if reservation.rerun else spend, unit,
             spec.dataset_id)
    return reservation


def bind_release_key(key: ReleaseKey, plan: Plan, source: InputSource) -> tuple[ReleaseKey, str]:
    """(the key every engine draws with, the input's keyed fingerprint): the key file's key bound to the
    dataset, release, plan fingerprint (spec, domain files, calibration, noise version) and input.
    Privacy: reusing a key file for anything else draws independent noise (see ReleaseKey.bind); the ledger
    refuses such reuse outright."""
    spec = plan.spec
    fingerprint = source.fingerprint(key)
    return key.bind(spec.dataset_id, spec.release_id, plan_fingerprint(plan), fingerprint), fingerprint


def public_text(error: BaseException) -> str:
    """An error as a message may quote it: a DPReleaseError's own text (public by construction: spec, schema,
    budget, files), else its type name only (an engine's or a kernel's text can quote confidential values)."""
    if isinstance(error, DPReleaseError):
        return f"{type(error).__name__}: {error}"
    return f"{type(error).__name__}; its message may quote confidential values and is not shown"


def _abort_quietly(book, reservation) -> None:
    """Abort a reservation of a run that published nothing; if the ledger cannot be reached the row
    stays reserved (never lost): `dprelease ledger reconcile` settles it later."""
    try:
        with shielded():  # a later signal never leaves the row reserved halfway
            abort(book, reservation)
    except Exception as error:  # noqa: BLE001 - the original failure is what the user must see
        LOG.warning("ledger: could not abort the reservation (%s); it stays reserved until "
                    "`dprelease ledger reconcile`", type(error).__name__)


def _discard(staged: StagedRelease) -> StagedPartsLeft | None:
    """Remove a staged release that will not be published; the StagedPartsLeft when parts in a store stayed."""
    try:
        staged.discard()
    except StagedPartsLeft as left:
        return left
    return None


def _staged_parts(staged: StagedRelease) -> list[tuple[str, str]]:
    """(path in the store, name in the release, SHA-256 reported) of every part the workers staged in the store."""
    if staged.remote_parts is None:
        return []
    return [(staged.remote_parts.object_path(name), name, sha256) for name, sha256 in staged.part_names]


def _remove_staged_parts(staged: StagedRelease) -> None:
    """After publication: the staging prefix removed (what stays is logged by count: the release is charged)."""
    if staged.remote_parts is None:
        return
    try:
        check_removed(staged.remote_parts)
    except StagedPartsLeft as left:
        LOG.warning("published; %s", left)


def _fetch_coding_check_files(final_dir: Path, remote: RemoteRelease) -> None:
    """Copy from the store into the local copy of a release whose parts were written there by the workers the few
    files the coding check reads (`coding_check.files_read`), each no longer than its manifest says; a failure
    leaves the check to say it could not run."""
    try:
        manifest = json.loads((final_dir / MANIFEST).read_bytes())
        sizes = {entry["path"]: entry["bytes"] for entry in manifest["files"]}
        for relative in files_read(manifest):
            target = inside(final_dir, relative)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                copy_bounded(remote, relative, sizes[relative], target)
    except Exception as error:  # noqa: BLE001 - published and charged: the check says it could not run
        LOG.info("the coding check's files could not be fetched (%s)", type(error).__name__)


def clean_leftovers(root: Path, release_id: str, remote: RemoteRelease | None = None) -> None:
    """Remove staging, replaced and spill directories (and staging prefixes beside `remote`, the release's place in
    a store) that dead runs of this release left behind, and the temporary directories of any dead run on this
    host (`RUN_TEMPORARY_PREFIXES`)."""
    removed: list = remove_stale(root, staging_prefix(release_id))
    if remote is not None:
        removed += remove_stale_remote(remote.store, remote.path.rsplit("/", 1)[0], store_staging_prefix(release_id),
                                      process_alive)
    removed += remove_stale(root, replaced_prefix(release_id))
    removed += remove_stale(Path(tempfile.gettempdir()), spill_prefix(release_id))
    removed += remove_stale(Path(tempfile.gettempdir()), input_copy_prefix(release_id))
    for prefix in RUN_TEMPORARY_PREFIXES:  # any release's: they hold no release id
        removed += remove_stale(Path(tempfile.gettempdir()), prefix)
    for path in removed:
        LOG.info("removed %s, left by a run of release %s that died", shown(path), release_id)


def make_engine(name: str, workers: int | None, master: str | None = None, runner: str | None = None,
                beam_options: list[str] | None = None, spark_session=None) -> Engine:
    if spark_session is not None and name != "spark":
        raise SpecError(f"engine = {name!r}: a Spark DataFrame runs on the spark engine")
    if name != "beam" and (runner or beam_options):
        raise SpecError(f"--runner / pipeline options: only the beam engine takes them (engine is {name})")
    if name == "embedded":
        if master:
            raise SpecError(f"--master = {shown(master)!r}: only the spark engine takes a master URL")
        return EmbeddedEngine(workers=workers)
    if name == "spark":
        from .engines.spark import SparkEngine

        return SparkEngine(master=master, session=spark_session)
    if name == "beam":
        if master:
            raise SpecError(f"--master = {shown(master)!r}: only the spark engine takes a master URL; "
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


@dataclass(frozen=True)
class ValueCheck:
    """The outcome of the value-level expectations: the (confidential) report's path, and the checks that failed
    in public words (`ValidationOutcome.failed_checks`: columns and what the spec asks, never a value or count),
    for the operator's console. Nothing of it is published."""

    report: Path
    failed: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failed


def _value_report(plan: Plan, engine: Engine, source: InputSource, validation: InputValidation,
                  created_at: str) -> ValueCheck:
    """Run the value-level expectations with the engine and write the (confidential) report to the
    internal directory."""
    LOG.info("input validation: checking values (%s engine)", engine.name)
    outcome = engine.validate_input(plan, source, validation.suite)
    report = write_internal_report(validation.internal_dir, plan, validation.suite, validation.schema_results,
                                   outcome, engine.name, source.files(), created_at)
    LOG.info("input validation: report written to the internal directory %s", validation.internal_dir)
    return ValueCheck(report, tuple(outcome.failed_checks()))


def check_input_values(plan: Plan, engine: Engine, source: InputSource, validation: InputValidation,
                       created_at: str) -> dict:
    """Validate the values (report to the internal directory only), before any key is drawn or budget reserved:
    the operator holds the data, and nothing is published. Without strict, what a run prints never depends on
    the outcome (it goes to the report); with strict, a failure stops the run there, before anything is
    reserved or drawn, naming the failed checks in public words (exit 1; data-dependent, internal).
    Returns the manifest's public block (suite hash and policies, no results)."""
    checked = _value_report(plan, engine, source, validation, created_at)
    if validation.strict and not checked.passed:
        raise StrictValidationError(f"--strict: the data does not match the spec ({'; '.join(checked.failed)}); "
                                    f"nothing was reserved or drawn; details in {shown(checked.report)}")
    return manifest_record(plan)


def validate_spec(spec: ReleaseSpec, spec_dir: Path, internal_dir: Path, *, input_path: str | None = None,
                  engine: str | None = None, master: str | None = None) -> ValueCheck:
    """Validate an input against the spec's suite without releasing anything (no key, no budget, no
    noise): schema failures raise (exit 2); the value-level report goes to `internal_dir` (a private
    directory, checked before anything is read)."""
    created_at = creation_time()
    plan = build_plan(spec, spec_dir)
    private_directory(internal_dir, "--internal-dir")
    engine_ = make_engine(engine or spec.engine, None, master)
    try:
        source = open_input(plan, spec_dir, input_path)
        engine_.check_input_schema(source)
        validation = check_input_schema(plan, source, internal_dir, strict=False)
        return _value_report(plan, engine_, source, validation, created_at)
    finally:
        engine_.close()


def run_release(spec_path: Path, **options) -> RunResult:
    """Run the release a spec file describes, end to end (see `run_release_spec` for `options`)."""
    spec, spec_dir = load_spec(spec_path)
    return run_release_spec(spec, spec_dir, **options)


def run_release_spec(
    spec: ReleaseSpec, spec_dir: Path, *, key_file: Path | None = None, out_dir: Path | None = None,
    input_path: str | None = None, engine: str | None = None, workers: int | None = None, overwrite: bool = False,
    master: str | None = None, ledger: str | Path | None = None, sign_key: Path | None = None,
    progress: ProgressHook = no_progress, invocation: Invocation | None = None, internal_dir: Path | None = None,
    strict: bool = False, runner: str | None = None, beam_options: list[str] | None = None,
    max_cells: int | None = None, layout: Layout | None = None, spark_session=None, input_table=None,
) -> RunResult:
    """Run a release end to end; relative paths of the spec start from `spec_dir`. Everything that can abort
    on public grounds (spec, cell limit, domain files, the schema of every input file, the release target, the
    key file) is checked before the key is drawn or any noise is sampled, and before the ledger reserves any
    budget. The ledger charge is committed before the release is renamed into place: a published release is
    always charged. `ledger=None` runs without one (the CLI's --no-ledger). SIGTERM runs every clean-up (spill,
    staging, reservation) before the process exits. `spark_session`: run the spark engine on this session
    (never stopped). `input_table`: an in-memory pyarrow Table as the input (embedded engine only)."""
    with terminate_as_exit():
        return _run_release(spec, Path(spec_dir), key_file=key_file, out_dir=out_dir, input_path=input_path,
                            engine=engine, workers=workers, overwrite=overwrite, master=master, ledger=ledger,
                            sign_key=sign_key, progress=progress, invocation=invocation,
                            internal_dir=internal_dir, strict=strict, runner=runner, beam_options=beam_options,
                            max_cells=max_cells, layout=layout or Layout(), spark_session=spark_session,
                            input_table=input_table)


def checked_progress(progress: ProgressHook) -> ProgressHook:
    """`progress` that first raises a SIGTERM whose exception a callback dropped (`raise_if_terminated`): each stage's
    progress stops such a run, not only the check before its commit."""
    def hook(stage: str, done: int, total: int) -> None:
        raise_if_terminated()
        progress(stage, done, total)
    return hook


def _run_release(spec: ReleaseSpec, spec_dir: Path, *, key_file, out_dir, input_path, engine, workers, overwrite,
                 master, ledger, sign_key, progress, invocation, internal_dir, strict, runner, beam_options,
                 max_cells, layout, spark_session, input_table) -> RunResult:
    created_at = creation_time()
    progress = checked_progress(progress or no_progress)
    plan = build_plan(spec, spec_dir)
    check_plan_limits(plan, max_cells, engine or spec.engine)
    LOG.info("planned release %s: %d tables, %d cells, %s budget", spec.release_id, len(plan.tables),
             plan.n_cells, spec.budget.definition)
    if invocation is None:
        invocation = run_invocation("python run_release", engine=engine or spec.engine, workers=workers,
                                    overwrite=overwrite, master=master, runner=runner, beam_options_given=beam_options,
                                    ledger=ledger, out_dir=out_dir, input_path=input_path, sign_key=sign_key,
                                    internal_dir=internal_dir, strict=strict, max_cells=max_cells,
                                    input_kind="in-memory table" if input_table is not None else "path")
    remote = _remote_target(spec, out_dir, overwrite)
    # every path resolved here, on the driver: a worker never resolves one against its own work directory
    root = run_temporary_directory("dprelease-publish@") if remote else \
        (Path(out_dir) if out_dir else spec_dir / spec.output.dir).absolute()
    final_dir = root / spec.release_id
    if internal_dir is not None:
        internal_dir = Path(internal_dir).absolute()
    if remote is None:
        if internal_dir is not None and internal_dir.resolve().is_relative_to(root.resolve()):
            raise SpecError(f"--internal-dir = {shown(internal_dir)!r}: must not be inside the output directory "
                            f"{shown(root)} (the validation report is confidential)")
        check_target(final_dir, overwrite)
    try:
        # the run's own files and ledger are checked before an engine starts or a record is read: a refused key,
        # signing key, internal directory or ledger costs no cluster session
        signer = load_private_key(read_named(sign_key, MAX_KEY_BYTES, "--sign-key"), sign_key) if sign_key else None
        if internal_dir is not None:
            private_directory(internal_dir, "--internal-dir")
        key_path = (Path(key_file) if key_file else default_key_path(spec_dir, spec.release_id, created_at)).absolute()
        check_key_location(key_path, root)
        key, reused = load_or_generate(key_path)
        book = open_ledger(ledger) if ledger is not None else None
        engine_ = make_engine(engine or spec.engine, workers, master, runner, beam_options, spark_session)
    except BaseException:
        if remote:
            shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        check_engine_selects(plan, engine_)
        if remote is not None and engine_.temp_inside(remote.store.uri(remote.path)):
            raise SpecError(f"--temp_location: inside the release's own prefix {shown(remote.uri)}; the run's key "
                            "files, noisy values and kept records never go inside a release")
        if input_table is not None and engine_.name != "embedded":
            raise SpecError(f"engine = {engine_.name!r}: an in-memory table is read by the embedded engine; "
                            "write it where the workers read it and pass its path")
        source = open_memory_input(plan, input_table) if input_table is not None else \
            open_input(plan, spec_dir, input_path)
        engine_.check_input_schema(source)
        LOG.info("input: %d %s file(s); engine %s", len(source.files()), source.format, engine_.name)
        validation = check_input_schema(plan, source, internal_dir, strict)
        validation_record = check_input_values(plan, engine_, source, validation, created_at) if validation else None
        release_key, input_fingerprint = bind_release_key(key, plan, source)  # every later read: these bytes
        clean_leftovers(root, spec.release_id, remote)
        raise_if_terminated()  # a dropped SIGTERM: nothing reserved
        reservation = _reserve(book, plan, key, input_fingerprint, remote.uri if remote else str(final_dir.resolve()))
        LOG.info("key %s (%s)", key.key_id(), "reused" if reused else "new")
        committed = False
        try:
            key_saved = reused
            # never refunded, so the key that re-publishes it free is kept first: a selection (what follows depends
            # on its draws), and workers staging parts in the release's store (noisy values written where a
            # killed driver, a late task or a versioned bucket could leave them readable)
            if plan.selections or _stages_in_store(plan, engine_, remote):
                raise_if_terminated()  # a dropped SIGTERM: the reservation aborted, nothing charged
                if not reused:
                    key.save(key_path)
                    key_saved = True
                if reservation:
                    reservation = charge_before_publication(book, reservation)
            held = reservation and not reservation.charged_early  # a charged row has no lease to renew
            lease = LeaseKeeper(book, reservation, warn=LOG.warning) if held else contextlib.nullcontext()
            with lease:
                plan = select_tables(plan, engine_, source, release_key, progress)
                if plan.selections and reservation:
                    check_selection(book, reservation, selection_fingerprint(plan))
                staged = _release_and_stage(plan, engine_, source, validation_record, created_at, key, key_path,
                                            key_saved, release_key, final_dir, progress, invocation, reservation,
                                            signer, layout, remote)
                try:
                    raise_if_terminated()  # a SIGTERM whose exception a callback dropped still stops the run here
                    if reservation:
                        commit(book, reservation, staged.manifest_sha256, staged.measurements_sha256)
                    committed = True
                    publish(staged, final_dir, overwrite)
                    if remote:
                        upload_release(final_dir, remote, overwrite, _staged_parts(staged),
                                       engine_.copy_parts if engine_.copies_parts else None)
                except BaseException as error:
                    left = _discard(staged)
                    if committed and reservation and isinstance(error, Exception):
                        raise PublishError(
                            f"release {spec.release_id}: charged in the ledger but not published "
                            f"({public_text(error)}); re-run it with --key-file {key_path} and the same "
                            "spec and input" + (" and --overwrite (where the failed upload could not remove what "
                                                "it copied under the release's prefix)" if remote else "") +
                            " to publish it at no further cost" + (f"; {left}" if left else "")) from error
                    if left is not None:
                        raise left from error
                    raise
                _remove_staged_parts(staged)
        except BaseException as error:
            if reservation and not committed:
                _abort_quietly(book, reservation)
            if reservation and reservation.charged_early and not committed and isinstance(error, Exception) \
                    and not isinstance(error, PublishError):
                raise PublishError(
                    f"release {spec.release_id}: charged in the ledger when its "
                    f"{'selection' if plan.selections else 'staging in the store'} started, but not "
                    f"published ({public_text(error)}); re-run it with --key-file {key_path} and the "
                    "same spec and input to publish it at no further cost") from error
            raise
        LOG.info("published %s", remote.uri if remote else final_dir)
        if remote and staged.remote_parts is not None:
            _fetch_coding_check_files(final_dir, remote)
        return RunResult(remote.uri if remote else final_dir, key_path, reused, plan, coding_warnings(final_dir))
    finally:
        engine_.close()  # a session the engine started never outlives the run
        if remote:
            shutil.rmtree(root, ignore_errors=True)


def _remote_target(spec: ReleaseSpec, out_dir, overwrite: bool) -> RemoteRelease | None:
    """The release's place in an object store when the output directory is a URI (`pipelines.storage.objects`), checked
    to be free (or `overwrite`); None for a local output directory."""
    target, field = (str(out_dir), "--out") if out_dir is not None else (spec.output.dir, "output.dir")
    if not is_uri(target):
        return None
    remote = release_under(target, spec.release_id, field)
    check_remote_target(remote, overwrite)
    return remote


def _release_and_stage(plan: Plan, engine_: Engine, source: InputSource, validation_record: dict | None,
                       created_at: str, key, key_path: Path, key_saved: bool, release_key: ReleaseKey, final_dir: Path,
                       progress, invocation: Invocation, reservation, signer, layout: Layout,
                       remote: RemoteRelease | None = None):
    """Save a fresh key, draw the noisy measurements, post-process and stage the release."""
    if not key_saved:
        key.save(key_path)
    record = dict(engine=engine_.name, key_id=key.key_id(), created_at=created_at,
                  invocation=invocation, ledger=reservation.record() if reservation else None,
                  sign_key=signer, input_validation=validation_record, layout=layout)
    if _stages_in_store(plan, engine_, remote):
        return _stage_in_store(plan, engine_, source, release_key, final_dir, progress, record, remote)
    if engine_.writes_parts and unit_tree(plan) is not None:
        return _stage_in_workers(plan, engine_, source, release_key, final_dir, progress, record)
    noisy = engine_.noisy_measurements(plan, source, release_key, progress)
    LOG.info("noisy measurements drawn for %d tables", len(plan.tables))
    workers = getattr(engine_, "workers", 1)
    published = post_process(plan, noisy, workers=workers, group_work=layout.group_work)
    LOG.info("post-processed %d tables (%s)", len(plan.tables), estimation_path(plan))
    return stage_release(plan, noisy, published, final_dir, progress=progress, workers=workers, **record)


def _stages_in_store(plan: Plan, engine_: Engine, remote: RemoteRelease | None) -> bool:
    """Whether the engine's workers write the release's parts into a staging prefix in its store."""
    return remote is not None and engine_.writes_parts and unit_tree(plan) is not None


def _stage_in_workers(plan: Plan, engine_: Engine, source: InputSource, release_key: ReleaseKey, final_dir: Path,
                      progress, record: dict) -> StagedRelease:
    """The distributed path: the engine's workers draw the noise, post-process unit group by unit group and
    write every part into the staging directory (which they must reach: shared storage on a cluster); the
    driver receives the file entries and variance summaries only, checks that every file is there, and
    writes the manifest."""
    staging, token = new_staging(final_dir)
    try:
        entries, summaries = engine_.release_parts(plan, source, release_key, staging, token, record["layout"],
                                                   progress)
        check_reported_parts(entries, expected_part_files(plan, record["layout"]))
        check_staged_files(staging, entries)
        LOG.info("noise, post-processing (%s) and %d files written by the %s workers", estimation_path(plan),
                 len(entries), engine_.name)
        return finish_release(plan, staging, entries, summaries=summaries, **record)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _stage_in_store(plan: Plan, engine_: Engine, source: InputSource, release_key: ReleaseKey, final_dir: Path,
                    progress, record: dict, remote: RemoteRelease) -> StagedRelease:
    """The distributed path for a release published to a store: the workers write every part straight into a
    staging prefix of this run beside the release's (`storage.staging`: no disk shared with the driver is
    needed); the driver checks that the prefix holds exactly the parts reported, with their sizes, and writes
    its own files (domain files, manifest) into a local staging directory; publication copies the parts inside
    the store and uploads the manifest last (`storage.upload_release`). A failure removes the prefix
    (StagedPartsLeft naming it when it cannot). The run was charged before the workers started
    (`charge_before_publication`): noisy values are written where a killed driver, a late task attempt or a
    versioned bucket could leave them readable, so the charge is never refunded; the key is saved first, so a
    re-run with it publishes at no further cost."""
    parts = new_remote_staging(remote, store_staging_prefix(final_dir.name), store_leftover_tag())
    try:
        staging, _ = new_staging(final_dir)
        try:
            entries, summaries = engine_.release_parts(plan, source, release_key, parts.uri, parts.token,
                                                       record["layout"], progress)
            check_reported_parts(entries, expected_part_files(plan, record["layout"]))
            check_remote_staged(parts, entries, (TABLES_DIR, MEASUREMENTS_DIR, DEBIASED_DIR))
            LOG.info("noise, post-processing (%s) and %d files written into the store by the %s workers",
                     estimation_path(plan), len(entries), engine_.name)
            staged = finish_release(plan, staging, entries, summaries=summaries, **record)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except BaseException as error:
        try:
            check_removed(parts)
        except StagedPartsLeft as left:
            raise left from error
        raise
    return dataclasses.replace(staged, remote_parts=parts,
                               part_names=tuple(sorted((e["path"], e["sha256"]) for e in entries)))

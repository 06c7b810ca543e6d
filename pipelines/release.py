"""Writing a release: tables, noisy measurements, public domain files and the manifest,
into a staging directory that is published by one atomic rename.

A crash leaves at most a staging directory (never a half release under the final name), which the
next run of the release removes; the manifest is written last, after every other file is hashed.
Between staging and publishing the caller commits the ledger charge, so a published release is
always charged.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dprelease.accounting.errors import DPReleaseError, SpecError
from dprelease.accounting.redact import shown
from dprelease.accounting.signing import SIGNATURE_FILE, fingerprint, sign
from dprelease.transforms.domains import dimension_labels

from .debiased import debiased_parts, debiased_tables, write_debiased
from .housekeeping import leftover_tag
from .manifest import VarianceSummary, build_manifest, domain_file_names, dump_manifest, sha256_file, table_summary
from .plan import MeanOutput, Plan, TablePlan
from .layout import MEASUREMENTS_DIR, TABLES_DIR, Layout, Part, mean_parts, table_parts
from .postprocessing import EstimateVariances, estimate_variances, mean_values
from .provenance import Invocation
from .storage import (STAGING_MARKER, RemoteStaging, StagedPartsLeft, check_release_target, inside,
                      remove_remote_staging)

LOG = logging.getLogger("dprelease")

GLS_VARIANCE = "gls_variance"
"""Column of a published count table: the variance of the cell's least-squares estimate before rounding."""


def row_labels(plan: Plan, dims, quantiles, start: int, stop: int) -> dict[str, pa.Array]:
    """The label columns of rows [start, stop) of a table: one per dimension (a quantile table has a row
    per cell and q, cell-major), then `q` for a quantile table. Public: from the plan."""
    repeat = max(1, len(quantiles))
    rows = np.arange(start, stop, dtype=np.int64)
    cells = rows // repeat
    columns = {}
    sizes = tuple(d.size for d in dims)
    coordinates = np.unravel_index(cells, sizes) if sizes else ()
    for dim, coords in zip(dims, coordinates):
        labels = pa.array(dimension_labels(plan.domains[dim.column], dim), type=pa.string())
        columns[dim.output_name] = labels.take(pa.array(np.asarray(coords, dtype=np.int64)))
    if quantiles:
        columns["q"] = pa.array(np.asarray([float(q) for q in quantiles])[rows % repeat], type=pa.float64())
    return columns


def rows_frame(plan: Plan, dims, quantiles, start: int, stop: int, values: dict[str, pa.Array]) -> pa.Table:
    """Rows [start, stop) of a table: its labels (`row_labels`), then `values`."""
    return pa.table({**row_labels(plan, dims, quantiles, start, stop), **values})


def table_values(table: TablePlan, values: np.ndarray, value_name: str,
                 variance: np.ndarray | None = None) -> dict[str, pa.Array]:
    """The value column of a table file, and (published count tables) `gls_variance`, the variance of the
    cell's least-squares estimate before rounding."""
    columns = {value_name: pa.array(np.asarray(values, dtype=np.int64))}
    if variance is not None:
        columns[GLS_VARIANCE] = pa.array(np.asarray(variance, dtype=np.float64))
    return columns


def table_frame(plan: Plan, table: TablePlan, values: np.ndarray, value_name: str,
                variance: np.ndarray | None = None) -> pa.Table:
    """Every row of a table (see `rows_frame`, `table_values`)."""
    return rows_frame(plan, table.dims, table.quantiles, 0, table.n_outputs,
                      table_values(table, values, value_name, variance))


def mean_column(mean: MeanOutput, noisy: dict[str, np.ndarray]) -> dict[str, pa.Array]:
    """The mean table's value column: per cell, noisy sum / noisy count clamped to the measure's [lo, hi];
    null where the noisy count is below 1. Post-processing of the raw measurements only."""
    return {"mean": pa.array(mean_values(mean, noisy), type=pa.float64(), from_pandas=True)}


def part_writers(part: Part, frame: pa.Table) -> list[tuple[str, Callable]]:
    """The two files of one part, (relative name, write(sink)): <stem>.parquet and <stem>.csv, each streamed
    into a path or a writable file. The bytes depend on the frame alone, so every engine and every retried
    attempt writes the same ones, wherever they go."""
    return [(f"{part.stem}.parquet", lambda sink: pq.write_table(frame, sink, compression="zstd")),
            (f"{part.stem}.csv", lambda sink: pacsv.write_csv(frame, sink))]


def write_part(root: Path, part: Part, frame: pa.Table) -> list[dict]:
    """Write one part's files (`part_writers`) below `root` (a name that would leave it is refused); return
    their manifest entries (path, SHA-256, bytes). Any worker can call it."""
    entries = []
    for relative, write in part_writers(part, frame):
        path = inside(root, relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, write)
        entries.append(_file_entry(root, path))
    return entries


def _write_atomically(path: Path, write) -> None:
    """`write(temporary path)` then rename into `path`: a retried or speculative task attempt of a distributed
    engine never leaves a torn file (the attempts write the same bytes)."""
    temporary = path.parent / f".{path.name}.{os.urandom(6).hex()}.tmp"
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_table(plan: Plan, root: Path, table: TablePlan, published: np.ndarray, noisy: np.ndarray, layout: Layout,
                variance: np.ndarray | None = None) -> list[dict]:
    """Write a whole table part by part (`layout.table_parts`): its published values (and variances) in tables/,
    its noisy measurements in measurements/, each part's label columns made once for both."""
    entries = []
    for part, measured in zip(table_parts(plan, table, TABLES_DIR, layout),
                              table_parts(plan, table, MEASUREMENTS_DIR, layout), strict=True):
        rows = slice(part.start, part.stop)
        labels = row_labels(plan, table.dims, table.quantiles, part.start, part.stop)
        values = table_values(table, published[rows], table.value_name, None if variance is None else variance[rows])
        entries += write_part(root, part, pa.table({**labels, **values}))
        values = table_values(table, noisy[rows], f"noisy_{table.value_name}")
        entries += write_part(root, measured, pa.table({**labels, **values}))
    return entries


def write_mean(plan: Plan, root: Path, mean: MeanOutput, noisy: dict[str, np.ndarray], layout: Layout) -> list[dict]:
    dims = plan.table(mean.sum_table).dims
    column = mean_column(mean, noisy)["mean"]
    return [entry for part in mean_parts(plan, mean, layout)
            for entry in write_part(root, part, rows_frame(plan, dims, (), part.start, part.stop,
                                                           {"mean": column.slice(part.start, part.stop - part.start)}))]


def _file_entry(root: Path, path: Path) -> dict:
    return {"path": path.relative_to(root).as_posix(), "sha256": sha256_file(path), "bytes": path.stat().st_size}


@dataclass(frozen=True)
class StagedRelease:
    """A complete release in its staging directory, not yet published; `manifest_sha256` is what the
    ledger commits before the rename."""

    staging: Path
    manifest_sha256: str
    measurements_sha256: str
    """SHA-256 over the noisy measurement files (their paths and hashes, in order): what a free re-run must
    reproduce exactly (`accounting.ledger.commit`)."""
    remote_parts: RemoteStaging | None = None
    """Where the workers staged the table parts in the release's store (then `staging` holds the driver's files
    only: domain files, manifest, signature); None when every file is in `staging`."""
    part_names: tuple[tuple[str, str], ...] = ()
    """(name, SHA-256 its worker reported) of each part in `remote_parts`."""

    def discard(self) -> None:
        """Remove what was staged; StagedPartsLeft when parts in a store could not all be removed."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if self.remote_parts is not None:
            check_removed(self.remote_parts)


def check_removed(staging: RemoteStaging) -> None:
    """Remove a staging prefix in a store; StagedPartsLeft naming it and counting what stayed, if anything did."""
    left = remove_remote_staging(staging)
    if left:
        raise StagedPartsLeft(f"{len(left)} staged object(s) with noisy values could not be removed from "
                                      f"{shown(staging.uri)}: remove them; the run is charged")


def staging_prefix(release_id: str) -> str:
    """Name prefix of a release's staging directories ('@' cannot occur in a release id, so the prefix
    names exactly one release's); the owner's `leftover_tag` follows it."""
    return f".{release_id}.staging@"


def store_staging_prefix(release_id: str) -> str:
    """Name prefix of a release's staging prefixes in an object store (`storage.staging`); the owner's
    `store_leftover_tag` follows it."""
    return f".{release_id}.staging+"


def replaced_prefix(release_id: str) -> str:
    """Name prefix of a release moved aside by --overwrite until it is removed."""
    return f".{release_id}.replaced@"


check_target = check_release_target
"""Where a release is published: `storage.check_release_target`."""

# STAGING_MARKER (from `storage.staging`) is a file in every staging directory holding a random token of its run:
# a worker writes a part only into a staging directory that holds its run's token (`check_staging`), so a worker
# that cannot see the driver's directory (a relative path resolved in its own work directory, or a disk the driver
# does not share) writes nothing at all, instead of noisy parts the driver can neither check nor remove. Removed
# before the manifest is written. A release published to a store is staged in the store instead.


def new_staging(final_dir: Path) -> tuple[Path, str]:
    """(a private staging directory beside `final_dir`, named after this process (see `leftover_tag`), and
    its run's token, written into its STAGING_MARKER)."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = final_dir.parent / f"{staging_prefix(final_dir.name)}{leftover_tag()}{os.urandom(4).hex()}"
    staging.mkdir(mode=0o700)
    token = os.urandom(16).hex()
    (staging / STAGING_MARKER).write_text(token)
    return staging, token


def check_staging(staging: Path, token: str) -> None:
    """Refuse (DPReleaseError) to write into `staging` unless it is the directory the driver created for this
    run (its marker holds `token`): called by a worker before its first write."""
    try:
        found = (Path(staging) / STAGING_MARKER).read_text()
    except OSError:
        found = None
    if found != token:
        raise DPReleaseError(f"the staging directory {staging} is not this run's as the driver made it (a relative "
                             "path, or a disk the workers do not share with the driver); nothing was written")


def stage_release(
    plan: Plan, noisy: dict[str, np.ndarray], published: dict[str, np.ndarray], final_dir: Path,
    *, engine: str, key_id: str, created_at: str, invocation: Invocation,
    progress=lambda stage, done, total: None, ledger: dict | None = None, sign_key=None,
    input_validation: dict | None = None, layout: Layout = Layout(), workers: int = 1,
) -> StagedRelease:
    """Write every file of the release into a private staging directory beside `final_dir`, the manifest
    last (and its signature when `sign_key`, an Ed25519 private key, is given), tables by `workers`
    threads (the writers run outside the interpreter lock). Nothing is published."""
    staging, _ = new_staging(final_dir)
    try:
        estimate = estimate_variances(plan)
        jobs = sorted(plan.tables, key=lambda table: -table.n_outputs)  # the largest first: the threads end together

        def write(table: TablePlan) -> tuple[list[dict], VarianceSummary | None]:
            """The table's files, and (a count table) the manifest's summary of the variances it wrote."""
            variance = estimate.per_cell.get(table.name)
            written = write_table(plan, staging, table, published[table.name], noisy[table.name], layout, variance)
            return written, None if variance is None else table_summary(plan, table, layout,
                                                                        lambda start, stop: variance[start:stop])

        entries: list[dict] = []
        summaries: dict[str, VarianceSummary] = {}
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for i, (table, (written, summary)) in enumerate(zip(jobs, pool.map(write, jobs))):
                entries += written
                if summary is not None:
                    summaries[table.name] = summary
                progress("write", i + 1, len(jobs))
        for mean in plan.means:
            entries += write_mean(plan, staging, mean, noisy, layout)
        for debiased in debiased_tables(plan):
            entries += write_debiased(plan, staging, debiased, noisy[debiased.table.name], layout)
        return finish_release(plan, staging, entries, engine=engine, key_id=key_id, created_at=created_at,
                              invocation=invocation, ledger=ledger, sign_key=sign_key,
                              input_validation=input_validation, estimate=estimate, layout=layout,
                              summaries=summaries)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def expected_part_files(plan: Plan, layout: Layout) -> set[str]:
    """Every table, measurement, mean and debiased file of `plan`'s release under `layout` (what `stage_release`
    writes, and what the workers of a distributed engine must report): public, from the plan."""
    parts = [p for table in plan.tables for folder in (TABLES_DIR, MEASUREMENTS_DIR)
             for p in table_parts(plan, table, folder, layout)]
    parts += [p for mean in plan.means for p in mean_parts(plan, mean, layout)]
    parts += [p for debiased in debiased_tables(plan) for p in debiased_parts(plan, debiased, layout)]
    return {f"{p.stem}{suffix}" for p in parts for suffix in (".parquet", ".csv")}


def check_reported_parts(entries: list[dict], expected: set[str]) -> None:
    """The workers reported exactly the release's files (`expected_part_files`): none missing (a release without
    one of its tables would verify), none other. DPReleaseError with counts and one name otherwise."""
    reported = {e["path"] for e in entries}
    missing, other = sorted(expected - reported), sorted(reported - expected)
    if missing or other:
        example = (missing or other)[0]
        raise DPReleaseError(f"the workers reported {len(missing)} of the release's files missing and {len(other)} "
                             f"file(s) it has no place for (e.g. {example!r}); nothing is published")


def check_staged_files(staging: Path, entries: list[dict]) -> None:
    """Every file a worker reported is in `staging` with its size, and none twice (a worker that wrote to
    storage the driver does not see would otherwise publish a release with missing files)."""
    paths = [e["path"] for e in entries]
    if len(set(paths)) != len(paths):
        raise DPReleaseError("the workers reported a release file twice")
    for entry in entries:
        path = staging / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise DPReleaseError(f"release file {entry['path']}: written by a worker but not found in {staging} "
                                 "with its size; the output directory must be storage every worker shares")


def finish_release(plan: Plan, staging: Path, entries: list[dict], *, engine: str, key_id: str, created_at: str,
                   invocation: Invocation, ledger: dict | None = None, sign_key=None,
                   input_validation: dict | None = None, estimate=None, layout: Layout = Layout(),
                   summaries: dict | None = None) -> StagedRelease:
    """Complete a staging directory whose table files are written (`entries`: their manifest entries): the
    domain files, then the manifest, last (and its signature). The caller removes the staging directory on
    failure."""
    entries = list(entries)
    (staging / STAGING_MARKER).unlink(missing_ok=True)
    for name, relative in domain_file_names(plan).items():
        path = inside(staging, relative)
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(code + "\n" for code in plan.domains[name].leaves))
        entries.append(_file_entry(staging, path))
    entries.sort(key=lambda e: e["path"])
    if estimate is None:
        estimate = estimate_variances(plan) if summaries is None else EstimateVariances({}, True)
    manifest = build_manifest(plan, engine, key_id, entries, created_at, invocation.record(),
                              ledger, input_validation, estimate, layout, summaries)
    if sign_key is not None:
        manifest["signature"] = {"algorithm": "Ed25519", "file": SIGNATURE_FILE,
                                 "public_key_sha256": fingerprint(sign_key.public_key())}
    manifest_bytes = dump_manifest(manifest)
    (staging / "manifest.json").write_bytes(manifest_bytes)
    if sign_key is not None:
        (staging / SIGNATURE_FILE).write_bytes(sign(sign_key, manifest_bytes))
    measured = [[e["path"], e["sha256"]] for e in entries if e["path"].startswith(f"{MEASUREMENTS_DIR}/")]
    return StagedRelease(staging, hashlib.sha256(manifest_bytes).hexdigest(),
                         hashlib.sha256(json.dumps(measured).encode()).hexdigest())


def publish(staged: StagedRelease, final_dir: Path, overwrite: bool) -> None:
    """Rename the staged release into place, atomically, readable by others only from now (after the ledger's
    commit: a run killed before it leaves no readable uncharged release). Without `overwrite` an existing
    directory is never replaced, even one that appeared after the run started (a concurrent run of the same
    release): the rename itself refuses. With `overwrite` the staged and the old release are exchanged in one
    rename (Linux renameat2 RENAME_EXCHANGE; a signal at any point leaves one of them in place, never neither) and
    the old one, now under the staging name, is removed; a failure to remove it is logged, not raised (the new
    release is published; a later run sweeps it)."""
    check_target(final_dir, overwrite)
    os.chmod(staged.staging, 0o755)
    if not overwrite or not final_dir.exists():
        try:
            rename_no_replace(staged.staging, final_dir)
        except FileExistsError:
            raise SpecError(f"output: release directory {final_dir} appeared while this run was writing "
                            "(another run of the same release?); nothing was replaced") from None
        return
    old = staged.staging if rename_exchange(staged.staging, final_dir) else _replace_in_two_renames(staged, final_dir)
    try:
        shutil.rmtree(old)
    except OSError as error:
        LOG.warning("published %s; the replaced release could not be removed from %s (%s)", final_dir, old,
                    type(error).__name__)


def _replace_in_two_renames(staged: StagedRelease, final_dir: Path) -> Path:
    """Where renameat2 is missing: the old release moved aside, the staged one renamed in; on any exception
    (a signal included) the old one is put back unless the new one is in place. Returns where the old one is."""
    old = final_dir.parent / f"{replaced_prefix(final_dir.name)}{leftover_tag()}{os.urandom(4).hex()}"
    try:
        os.rename(final_dir, old)
        rename_no_replace(staged.staging, final_dir)
    except BaseException:
        if old.exists() and not final_dir.exists():
            os.rename(old, final_dir)
        raise
    return old


_RENAME_NOREPLACE = 1


def rename_no_replace(source: Path, target: Path) -> None:
    """rename(2) that fails with FileExistsError when `target` exists (Linux renameat2 RENAME_NOREPLACE;
    elsewhere a checked os.rename, which still refuses a non-empty target directory)."""
    libc = _libc()
    if libc is not None:
        result = libc.renameat2(-100, os.fsencode(source), -100, os.fsencode(target), _RENAME_NOREPLACE)
        if result == 0:
            return
        error = ctypes.get_errno()
        if error == errno.EEXIST:
            raise FileExistsError(error, os.strerror(error), str(target))
        if error not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(error, os.strerror(error), str(target))
    if target.exists() or target.is_symlink():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    try:
        os.rename(source, target)
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(error.errno, error.strerror, str(target)) from None
        raise


_RENAME_EXCHANGE = 2


def rename_exchange(source: Path, target: Path) -> bool:
    """Exchange two existing paths in one rename(2) (Linux renameat2 RENAME_EXCHANGE): True when done, False where
    the call or the flag is not supported (the caller falls back); any other failure raises OSError."""
    libc = _libc()
    if libc is None:
        return False
    if libc.renameat2(-100, os.fsencode(source), -100, os.fsencode(target), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(error, os.strerror(error), str(target))


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return libc
    except (OSError, AttributeError):
        return None

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
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import redact_command_line
from dprelease.accounting.signing import SIGNATURE_FILE, fingerprint, sign
from dprelease.transforms.aggregate import unravel_cells
from dprelease.transforms.domains import dimension_labels

from .housekeeping import leftover_tag
from .manifest import build_manifest, domain_file_names, dump_manifest, sha256_file
from .plan import MeanOutput, Plan, TablePlan
from .postprocessing import estimate_variances, mean_values
from .safe_files import inside

LOG = logging.getLogger("dprelease")

TABLES_DIR = "tables"
GLS_VARIANCE = "gls_variance"
"""Column of a published count table: the variance of the cell's least-squares estimate before rounding."""
MEASUREMENTS_DIR = "measurements"


def table_frame(plan: Plan, table: TablePlan, values: np.ndarray, value_name: str,
                variance: np.ndarray | None = None) -> pa.Table:
    """One row per public cell (a quantile table: per cell and q, cell-major): a label column per
    dimension, then `q` for a quantile table, then the value column, then (published count tables)
    `gls_variance`, the variance of the cell's least-squares estimate before rounding."""
    columns = {value_name: pa.array(np.asarray(values, dtype=np.int64))}
    if variance is not None:
        columns[GLS_VARIANCE] = pa.array(np.asarray(variance, dtype=np.float64))
    return _cell_frame(plan, table.dims, table.quantiles, columns)


def _cell_frame(plan: Plan, dims, quantiles, values: dict[str, pa.Array]) -> pa.Table:
    columns = {}
    repeat = max(1, len(quantiles))
    coordinates = unravel_cells(tuple(d.size for d in dims))
    for dim, coords in zip(dims, coordinates):
        labels = pa.array(dimension_labels(plan.domains[dim.column], dim), type=pa.string())
        columns[dim.output_name] = labels.take(pa.array(np.repeat(coords, repeat)))
    if quantiles:
        n_cells = int(np.prod([d.size for d in dims])) if dims else 1
        columns["q"] = pa.array(np.tile([float(q) for q in quantiles], n_cells), type=pa.float64())
    return pa.table({**columns, **values})


def mean_frame(plan: Plan, mean: MeanOutput, noisy: dict[str, np.ndarray]) -> pa.Table:
    """The mean table of a mean query: per cell, noisy sum / noisy count clamped to the measure's [lo, hi];
    null where the noisy count is below 1. Post-processing of the raw measurements only."""
    table = plan.table(mean.sum_table)
    return _cell_frame(plan, table.dims, (), {"mean": pa.array(mean_values(mean, noisy), type=pa.float64(), from_pandas=True)})


def _write_frame(frame: pa.Table, root: Path, relative_stem: str) -> list[Path]:
    """Write a frame as <stem>.parquet and <stem>.csv below `root` (a name that would leave it is refused)."""
    stem = inside(root, relative_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    parquet_path = stem.parent / f"{stem.name}.parquet"
    csv_path = stem.parent / f"{stem.name}.csv"
    pq.write_table(frame, parquet_path, compression="zstd")
    pacsv.write_csv(frame, csv_path)
    return [parquet_path, csv_path]


def _file_entry(root: Path, path: Path) -> dict:
    return {"path": path.relative_to(root).as_posix(), "sha256": sha256_file(path), "bytes": path.stat().st_size}


@dataclass(frozen=True)
class StagedRelease:
    """A complete release in its staging directory, not yet published; `manifest_sha256` is what the
    ledger commits before the rename."""

    staging: Path
    manifest_sha256: str

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def staging_prefix(release_id: str) -> str:
    """Name prefix of a release's staging directories ('@' cannot occur in a release id, so the prefix
    names exactly one release's); the owner's `leftover_tag` follows it."""
    return f".{release_id}.staging@"


def replaced_prefix(release_id: str) -> str:
    """Name prefix of a release moved aside by --overwrite until it is removed."""
    return f".{release_id}.replaced@"


def check_target(final_dir: Path, overwrite: bool) -> None:
    """Refuse to publish over an existing release without --overwrite, and over a symbolic link ever
    (replacing one would delete or write outside the release directory)."""
    if final_dir.is_symlink():
        raise SpecError(f"output: release directory {final_dir} is a symbolic link; publish to a real directory")
    if final_dir.exists() and not overwrite:
        raise SpecError(f"output: release directory {final_dir} already exists; pass --overwrite to replace it")
    if final_dir.exists() and not final_dir.is_dir():
        raise SpecError(f"output: {final_dir} exists and is not a directory")


def stage_release(
    plan: Plan, noisy: dict[str, np.ndarray], published: dict[str, np.ndarray], final_dir: Path,
    *, engine: str, key_id: str, created_at: str, command_line: list[str],
    progress=lambda stage, done, total: None, ledger: dict | None = None, sign_key=None,
    input_validation: dict | None = None,
) -> StagedRelease:
    """Write every file of the release into a private staging directory beside `final_dir`, the manifest
    last (and its signature when `sign_key`, an Ed25519 private key, is given). Nothing is published."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = final_dir.parent / f"{staging_prefix(final_dir.name)}{leftover_tag()}{os.urandom(4).hex()}"
    staging.mkdir(mode=0o700)
    try:
        files: list[Path] = []
        estimate = estimate_variances(plan)
        for i, table in enumerate(plan.tables):
            files += _write_frame(table_frame(plan, table, published[table.name], table.value_name,
                                              estimate.per_cell.get(table.name)),
                                  staging, f"{TABLES_DIR}/{table.name}")
            files += _write_frame(table_frame(plan, table, noisy[table.name], f"noisy_{table.value_name}"),
                                  staging, f"{MEASUREMENTS_DIR}/{table.name}")
            progress("write", i + 1, len(plan.tables))
        for mean in plan.means:
            files += _write_frame(mean_frame(plan, mean, noisy), staging, f"{TABLES_DIR}/{mean.name}")
        for name, relative in domain_file_names(plan).items():
            path = inside(staging, relative)
            path.parent.mkdir(exist_ok=True)
            path.write_text("".join(code + "\n" for code in plan.domains[name].leaves))
            files.append(path)
        entries = [_file_entry(staging, p) for p in sorted(files)]
        manifest = build_manifest(plan, engine, key_id, entries, created_at, redact_command_line(command_line),
                                  ledger, input_validation, estimate)
        if sign_key is not None:
            manifest["signature"] = {"algorithm": "Ed25519", "file": SIGNATURE_FILE,
                                     "public_key_sha256": fingerprint(sign_key.public_key())}
        manifest_bytes = dump_manifest(manifest)
        (staging / "manifest.json").write_bytes(manifest_bytes)
        if sign_key is not None:
            (staging / SIGNATURE_FILE).write_bytes(sign(sign_key, manifest_bytes))
        os.chmod(staging, 0o755)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return StagedRelease(staging, hashlib.sha256(manifest_bytes).hexdigest())


def publish(staged: StagedRelease, final_dir: Path, overwrite: bool) -> None:
    """Rename the staged release into place, atomically. Without `overwrite` an existing directory is
    never replaced, even one that appeared after the run started (a concurrent run of the same
    release): the rename itself refuses. With `overwrite` the old release is moved aside first and
    removed afterwards; a failure to remove it is logged, not raised (the new release is published)."""
    check_target(final_dir, overwrite)
    if not overwrite or not final_dir.exists():
        try:
            rename_no_replace(staged.staging, final_dir)
        except FileExistsError:
            raise SpecError(f"output: release directory {final_dir} appeared while this run was writing "
                            "(another run of the same release?); nothing was replaced") from None
        return
    old = final_dir.parent / f"{replaced_prefix(final_dir.name)}{leftover_tag()}{os.urandom(4).hex()}"
    os.rename(final_dir, old)
    try:
        rename_no_replace(staged.staging, final_dir)
    except BaseException:
        os.rename(old, final_dir)
        raise
    try:
        shutil.rmtree(old)
    except OSError as error:
        LOG.warning("published %s; the replaced release could not be removed from %s (%s)", final_dir, old,
                    type(error).__name__)


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


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return libc
    except (OSError, AttributeError):
        return None

"""Writing a release: tables, noisy measurements, public domain files and the manifest,
into a staging directory that is published by one atomic rename.

A crash leaves at most a staging directory (never a half release under the final name);
the manifest is written last, after every other file is hashed.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dprelease.accounting.errors import SpecError
from dprelease.accounting.signing import SIGNATURE_FILE, fingerprint, sign
from dprelease.transforms.aggregate import unravel_cells
from dprelease.transforms.domains import GeographyDomain, dimension_labels

from .manifest import build_manifest, dump_manifest, sha256_file
from .plan import Plan, TablePlan

TABLES_DIR = "tables"
MEASUREMENTS_DIR = "measurements"
DOMAINS_DIR = "domains"


def table_frame(plan: Plan, table: TablePlan, values: np.ndarray, value_name: str) -> pa.Table:
    """One row per public cell: a label column per dimension, then the value column."""
    columns = {}
    coordinates = unravel_cells(tuple(d.size for d in table.dims))
    for dim, coords in zip(table.dims, coordinates):
        labels = pa.array(dimension_labels(plan.domains[dim.column], dim), type=pa.string())
        columns[dim.output_name] = labels.take(pa.array(coords))
    columns[value_name] = pa.array(np.asarray(values, dtype=np.int64))
    return pa.table(columns)


def _write_frame(frame: pa.Table, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    parquet_path = stem.parent / f"{stem.name}.parquet"
    csv_path = stem.parent / f"{stem.name}.csv"
    pq.write_table(frame, parquet_path, compression="zstd")
    pacsv.write_csv(frame, csv_path)
    return [parquet_path, csv_path]


def _file_entry(root: Path, path: Path) -> dict:
    return {"path": path.relative_to(root).as_posix(), "sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_release(
    plan: Plan, noisy: dict[str, np.ndarray], published: dict[str, np.ndarray], final_dir: Path,
    *, engine: str, key_id: str, created_at: str, command_line: list[str], overwrite: bool = False,
    progress=lambda stage, done, total: None, ledger: dict | None = None, sign_key=None,
    input_validation: dict | None = None,
) -> Path:
    """`sign_key`: an Ed25519 private key; the manifest then names its public key and is signed."""
    """Write and atomically publish the release directory `final_dir`."""
    final_dir = Path(final_dir)
    if final_dir.exists() and not overwrite:
        raise SpecError(f"output: release directory {final_dir} already exists; pass --overwrite to replace it")
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = final_dir.parent / f".{final_dir.name}.staging-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        files: list[Path] = []
        for i, table in enumerate(plan.tables):
            files += _write_frame(table_frame(plan, table, published[table.name], "count"),
                                  staging / TABLES_DIR / table.name)
            files += _write_frame(table_frame(plan, table, noisy[table.name], "noisy_count"),
                                  staging / MEASUREMENTS_DIR / table.name)
            progress("write", i + 1, len(plan.tables))
        domain_files = {}
        for name, domain in plan.domains.items():
            if isinstance(domain, GeographyDomain):
                path = staging / DOMAINS_DIR / f"{name}.txt"
                path.parent.mkdir(exist_ok=True)
                path.write_text("".join(code + "\n" for code in domain.leaves))
                files.append(path)
                domain_files[name] = path.relative_to(staging).as_posix()
        entries = [_file_entry(staging, p) for p in sorted(files)]
        manifest = build_manifest(plan, engine, key_id, entries, domain_files, created_at, command_line, ledger,
                                  input_validation)
        if sign_key is not None:
            manifest["signature"] = {"algorithm": "Ed25519", "file": SIGNATURE_FILE,
                                     "public_key_sha256": fingerprint(sign_key.public_key())}
        manifest_bytes = dump_manifest(manifest)
        (staging / "manifest.json").write_bytes(manifest_bytes)
        if sign_key is not None:
            (staging / SIGNATURE_FILE).write_bytes(sign(sign_key, manifest_bytes))
        _publish(staging, final_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final_dir


def _publish(staging: Path, final_dir: Path) -> None:
    """Atomic rename; an existing release (only with overwrite) is moved aside first, then removed."""
    old = None
    if final_dir.exists():
        old = final_dir.parent / f".{final_dir.name}.replaced-{os.getpid()}"
        os.rename(final_dir, old)
    os.rename(staging, final_dir)
    if old is not None:
        shutil.rmtree(old)

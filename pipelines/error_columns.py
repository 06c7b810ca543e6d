"""A published table read back with its error columns (post-processing of public files only).

Count tables carry `gls_variance` per cell (exact, before rounding); `std` is its square root. Sums (and a mean's
sum and count) carry their noise's `std` and `margin_95`, the same in every cell (from the manifest). Quantiles
carry `rank_margin_95` (the exponential mechanism's utility bound, in records). A mean S/C carries `std_approx`:
the delta method, sqrt(Var S + (S/C)^2 Var C) / C, from the noisy S and C the mean divides (measurements/)
and the noises' variances: an approximation (the ratio of noisy values has no finite variance),
undefined (NaN) where C < 1 (where the mean is null).
"""
from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dprelease.accounting.errors import DPReleaseError

from .storage import UnsafeFile, buffer_inside, safe_relative


def table_files(manifest: dict, name: str, folder: str = "tables") -> list[str]:
    """The Parquet files of table `name` in a release's `folder` (one file, or its parts in order), from the
    manifest."""
    single = f"{folder}/{name}.parquet"
    prefix = f"{folder}/{name}/"
    # an unverified manifest cannot point a reader outside the release
    paths = [f["path"] for f in manifest["files"] if safe_relative(f.get("path")) is not None]
    if single in paths:
        return [single]
    parts = [p for p in paths if p.startswith(prefix) and p.endswith(".parquet")]
    return sorted(parts, key=_part_number)


def _part_number(path: str) -> tuple[int, str]:
    """Parts in their order (part-00000, ..., part-100000: by number, not as text)."""
    found = re.search(r"part-([0-9]+)\.parquet$", path)
    return (int(found.group(1)) if found else -1, path)


MAX_ROW_BYTES = 4096
"""Largest decoded row a published table file may declare (labels, value, variance): what verify allows too."""
MAX_ROWS = 100_000_000


def open_table_file(directory: Path, manifest: dict, relative: str) -> pq.ParquetFile:
    """A Parquet file of the release, read through the storage layer: a regular file inside the release (no link
    followed), at most the size its manifest lists, and declaring no more rows than the table has cells (at most
    MAX_ROWS) nor more decoded bytes than MAX_ROW_BYTES a row: a small file that would decompress to gigabytes is
    refused from its footer. DPReleaseError naming the file otherwise."""
    listed = next((e.get("bytes") for e in manifest.get("files") or [] if isinstance(e, dict)
                   and e.get("path") == relative), None)
    if type(listed) is not int or listed < 0:  # noqa: E721 (a bool is no size)
        raise DPReleaseError(f"{directory}: {relative} has no size in the manifest")
    try:
        file = pq.ParquetFile(buffer_inside(Path(directory), relative, listed))
    except UnsafeFile as error:
        raise DPReleaseError(f"{directory}: {error}") from None
    except (pa.ArrowException, OSError) as error:
        raise DPReleaseError(f"{directory}: {relative} is not a readable Parquet file ({type(error).__name__})") \
            from None
    rows, limit = file.metadata.num_rows, min(_cells_of(manifest, relative), MAX_ROWS)
    decoded = sum(file.metadata.row_group(i).total_byte_size for i in range(file.metadata.num_row_groups))
    if rows > limit or decoded > max(rows, 1) * MAX_ROW_BYTES:
        raise DPReleaseError(f"{directory}: {relative} declares more rows or bytes than its table can hold")
    return file


def _cells_of(manifest: dict, relative: str) -> int:
    """The rows a table file of the release can hold: its table's cells (times its quantiles), from the manifest
    (the whole table's, for a part)."""
    stem = PurePosixPath(relative).parts[1] if len(PurePosixPath(relative).parts) > 1 else ""
    name = stem.removesuffix(".parquet")
    for table in manifest.get("tables") or []:
        if isinstance(table, dict) and table.get("name") == name and type(table.get("cells")) is int:  # noqa: E721
            quantiles = table.get("quantile", {}).get("q") if isinstance(table.get("quantile"), dict) else None
            return table["cells"] * max(1, len(quantiles) if isinstance(quantiles, list) else 1)
    for mean in manifest.get("means") or []:
        if isinstance(mean, dict) and mean.get("table") == name:
            return _cells_of(manifest, f"tables/{mean.get('sum_table')}.parquet")
    return 0


def read_table(directory: Path, manifest: dict, name: str, folder: str = "tables") -> pa.Table:
    files = table_files(manifest, name, folder)
    if not files:
        raise DPReleaseError(f"{directory}: table {name!r} has no Parquet file in the manifest")
    return pa.concat_tables([open_table_file(directory, manifest, f).read() for f in files])


def _entry(manifest: dict, name: str) -> dict | None:
    return next((t for t in manifest["tables"] if t["name"] == name), None)


def with_error_columns(directory: Path, manifest: dict, name: str):
    """Table `name` as a pandas DataFrame with its error columns (see the module's docstring)."""
    frame = read_table(directory, manifest, name).to_pandas()
    entry = _entry(manifest, name)
    if entry is None:  # a mean: the ratio of its sum and count tables
        return _mean_with_error(directory, manifest, name, frame)
    expected = entry.get("expected_error") or {}
    if "gls_variance" in frame.columns:
        frame["std"] = np.sqrt(frame["gls_variance"])
    elif "rank_margin_95" in expected:
        frame["rank_margin_95"] = expected["rank_margin_95"]
    elif "std" in expected:
        frame["std"] = expected["std"]
        frame["margin_95"] = expected["margin_95"]
    return frame


def _mean_with_error(directory: Path, manifest: dict, name: str, frame):
    means = manifest.get("means") or []
    mean = next((m for m in means if m["table"] == name), None)
    if mean is None:
        raise DPReleaseError(f"{directory}: table {name!r} is neither a table nor a mean of the manifest")
    sums = read_table(directory, manifest, mean["sum_table"], "measurements").column("noisy_sum")
    counts = read_table(directory, manifest, mean["count_table"], "measurements").column("noisy_count")
    sums, counts = sums.to_numpy(zero_copy_only=False), counts.to_numpy(zero_copy_only=False)
    var_sum = _entry(manifest, mean["sum_table"])["expected_error"]["variance"]
    var_count = _entry(manifest, mean["count_table"])["expected_error"]["variance"]
    if not len(sums) == len(counts) == len(frame):
        raise DPReleaseError(f"{directory}: mean {name!r} has {len(frame)} rows, its sum and count tables "
                             f"{len(sums)} and {len(counts)}")
    sums, counts = sums.astype(float), counts.astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = sums / counts  # the delta method's point is S/C itself (the published mean is it, clamped)
        std = np.sqrt(var_sum + ratio * ratio * var_count) / counts
    frame["std_approx"] = np.where(counts >= 1, std, math.nan)
    return frame

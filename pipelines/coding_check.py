"""A check for mis-coded categories, computed from the published release only.

A spec whose `values` do not match the data's codes (`[Female, Male]` over data coded `F`/`M`) sends every
record to the `(other)` cell, and the release is published without complaint. This check reads the published
(noisy, post-processed) count tables and says when a column's or a geography level's `(other)` cells hold a
large share of the total (and more than noise could put there).

Privacy: it reads public files of the release only, so it is post-processing of the noisy measurements and
spends no budget; its warnings may be printed, logged and published (the report shows them).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc

from dprelease.transforms.domains import OTHER_LABEL

from .error_columns import open_table_file, table_files
from .storage import read_inside
from .storage.objects import MAX_MANIFEST_BYTES

OTHER_SHARE_LIMIT = 0.25
"""A dimension whose `(other)` cells hold more than this share of a published count table's total is named."""


@dataclass(frozen=True)
class OtherShare:
    """The share of a published count table's total that falls in one dimension's `(other)` cells."""

    dimension: str
    table: str
    share: float

    def message(self) -> str:
        return (f"{self.share:.0%} of the published total of {self.table} is in {self.dimension} = {OTHER_LABEL}: "
                f"check that the spec's values for {self.dimension} are spelled as the data codes them")


def _label_column(dimension: dict) -> str:
    """The column of a published table that holds a dimension's labels (a geography level's name, or the
    attribute's column)."""
    return dimension.get("level") or dimension["column"]


def _count_tables_by_dimension(manifest: dict) -> dict[str, dict]:
    """For each dimension label column, the published count table with the fewest cells that has it."""
    smallest: dict[str, dict] = {}
    for table in manifest.get("tables", []):
        if table.get("statistic") not in (None, "count") or table.get("kind") == "quantile":
            continue
        for dimension in table.get("dimensions", []):
            name = _label_column(dimension)
            if name not in smallest or table["cells"] < smallest[name]["cells"]:
                smallest[name] = table
    return smallest


def _other_share(directory: Path, manifest: dict, table: str, column: str) -> float | None:
    """The share of the table's published total in rows labelled (other) in `column`; None: no such rows, a zero
    total, or an (other) total within twice its own standard error (noise on a small table, not a coding
    problem; the count tables' gls_variance of the (other) cells, summed, as if independent)."""
    total = other = 0
    variance = 0.0
    for path in table_files(manifest, table):
        file = open_table_file(Path(directory), manifest, path)
        wanted = [c for c in (column, "count", "gls_variance") if c in file.schema_arrow.names]
        part = file.read(columns=wanted)
        total += int(pc.sum(part["count"]).as_py() or 0)
        labelled_other = pc.equal(part[column], OTHER_LABEL)
        other += int(pc.sum(pc.filter(part["count"], labelled_other)).as_py() or 0)
        if "gls_variance" in part.column_names:
            variance += float(pc.sum(pc.filter(part["gls_variance"], labelled_other)).as_py() or 0.0)
    if total <= 0 or other <= 0 or other <= 2 * math.sqrt(variance):
        return None
    return other / total


def files_read(manifest: dict) -> list[str]:
    """The release files the check reads (the Parquet parts of the smallest count table of each dimension)."""
    names = sorted({table["name"] for table in _count_tables_by_dimension(manifest).values()})
    return [path for name in names for path in table_files(manifest, name)]


def other_shares(directory: Path, manifest: dict) -> list[OtherShare]:
    """Every dimension whose (other) cells hold more than OTHER_SHARE_LIMIT of the total of the smallest
    published count table that has it (post-processing of the published tables only)."""
    found = []
    for column, table in sorted(_count_tables_by_dimension(manifest).items()):
        share = _other_share(directory, manifest, table["name"], column)
        if share is not None and share > OTHER_SHARE_LIMIT:
            found.append(OtherShare(column, table["name"], share))
    return found


def coding_warnings(release_dir: Path) -> list[str]:
    """The messages of `other_shares` for a just-published release (its local copy). Never raises: the release is
    published and charged by then, so a failure here is said, not turned into a failed run."""
    try:
        manifest = json.loads(read_inside(Path(release_dir), "manifest.json", MAX_MANIFEST_BYTES))
        return [share.message() for share in other_shares(release_dir, manifest)]
    except Exception as error:  # noqa: BLE001 - see the docstring
        return [f"the coding check of the (other) cells could not run ({type(error).__name__})"]

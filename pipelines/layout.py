"""Where every table's rows go in a release: one file, or parts. A public function of the plan, shared by
every writer (the embedded engine's, Spark executors', Beam workers') and by `verify`.

A count table of a tree of units (`postprocessing.unit_tree`) is written per group of its level's pass
(`transforms.units.groups`): one file when the level is one group, else `NAME/part-GGGGG` per group, each
a contiguous range of units, written by whichever worker ran that group. Every other table, and every
table of a release estimated globally, is one file up to PART_ROWS rows, else parts of PART_ROWS rows
(whole cells of a quantile table). Each part is a Parquet file and a CSV file of the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from dprelease.transforms.units.groups import GROUP_WORK, transitions

from .plan import MeanOutput, Plan, TablePlan

TABLES_DIR = "tables"
MEASUREMENTS_DIR = "measurements"
PART_ROWS = 4_000_000
"""Rows per part of a table that is not written per group of units."""
MAX_LAYOUT = 10**12
MIN_LAYOUT = 64
"""Smallest sizes accepted (a forged manifest cannot make verify expect a part per cell)."""


@dataclass(frozen=True)
class Layout:
    """The two public sizes that decide a release's parts; recorded in the manifest (`layout`), where
    `verify` takes them from. `group_work`: work per group of units (`transforms.units.groups`);
    `part_rows`: rows per part of any other table."""

    group_work: int = GROUP_WORK
    part_rows: int = PART_ROWS

    def __post_init__(self) -> None:
        for name in ("group_work", "part_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not MIN_LAYOUT <= value <= MAX_LAYOUT:
                raise ValueError(f"layout.{name} ({value!r}) must be an integer in [{MIN_LAYOUT}, {MAX_LAYOUT}]")

    def record(self) -> dict:
        return {"group_work": self.group_work, "part_rows": self.part_rows}


LEGACY_LAYOUT = Layout(MAX_LAYOUT, MAX_LAYOUT)
"""Manifests before version 3: every table one file."""


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of a table, written to `stem`.parquet and `stem`.csv (relative to the release)."""

    stem: str
    start: int
    stop: int


def _level_groups(plan: Plan, table: TablePlan, layout: Layout):
    """(transition, rows per unit) of a tree count table below the root; None for any other table."""
    from .postprocessing import unit_tree

    tree = unit_tree(plan)
    if tree is None or table.name not in tree.tables:
        return None
    level = tree.level_of(table.name)
    if level.index == 0:
        return None
    return transitions(tree, layout.group_work)[level.index - 1], level.table(table.name).size


def _by_rows(stem: str, rows: int, quantum: int, layout: Layout) -> list[Part]:
    if rows <= layout.part_rows:
        return [Part(stem, 0, rows)]
    step = max(1, layout.part_rows // quantum) * quantum
    return [Part(f"{stem}/part-{k:05d}", start, min(start + step, rows))
            for k, start in enumerate(range(0, rows, step))]


def table_parts(plan: Plan, table: TablePlan, folder: str, layout: Layout) -> list[Part]:
    """The parts of a table in tables/ or measurements/."""
    stem = f"{folder}/{table.name}"
    grouped = _level_groups(plan, table, layout)
    if grouped is None:
        return _by_rows(stem, table.n_outputs, max(1, len(table.quantiles)), layout)
    transition, per_unit = grouped
    if transition.count == 1:
        return [Part(stem, 0, table.n_outputs)]
    starts = transition.child_start * per_unit
    return [Part(f"{stem}/part-{g:05d}", int(starts[g]), int(starts[g + 1])) for g in range(transition.count)]


def mean_parts(plan: Plan, mean: MeanOutput, layout: Layout) -> list[Part]:
    return _by_rows(f"{TABLES_DIR}/{mean.name}", plan.table(mean.sum_table).n_cells, 1, layout)


def release_parts(plan: Plan, layout: Layout) -> list[Part]:
    """Every part a release of this plan writes: its tables and measurements, means, debiased tables."""
    from .debiased import debiased_parts, debiased_tables

    parts = [p for t in plan.tables for folder in (TABLES_DIR, MEASUREMENTS_DIR)
             for p in table_parts(plan, t, folder, layout)]
    parts += [p for m in plan.means for p in mean_parts(plan, m, layout)]
    parts += [p for d in debiased_tables(plan) for p in debiased_parts(plan, d, layout)]
    return parts


def release_files(plan: Plan, layout: Layout) -> set[str]:
    """Every table file a release of this plan holds (domain files and the manifest aside)."""
    return {f"{part.stem}.{ext}" for part in release_parts(plan, layout) for ext in ("parquet", "csv")}


def layout_of(manifest: dict, version: int, problems: list[str]) -> Layout:
    """The layout a manifest states (version 3 and on; earlier ones wrote every table as one file)."""
    if version < 3:
        return LEGACY_LAYOUT
    record = manifest.get("layout")
    try:
        return Layout(**record) if isinstance(record, dict) and set(record) == {"group_work", "part_rows"} \
            else Layout(record)
    except (TypeError, ValueError) as error:
        problems.append(f"layout: {error if isinstance(error, ValueError) else 'must be {group_work, part_rows}'}")
        return Layout()

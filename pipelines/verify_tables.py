"""verify's checks of the table files: every structural property a release claims, on the files themselves.

For every table, in tables/ (published) and measurements/ (raw noisy):
- the Parquet and CSV files hold exactly the expected columns, in order, with their types: a label column
  per dimension, `q` for a quantile table, the value column, and (published count tables, manifests of
  version 2 and on) `gls_variance`; nothing else (no `true_count`), nothing missing;
- a row per public cell (and q), labels equal to the public domain in the plan's cell order;
- the CSV file equal to the Parquet file, value for value;
- values: integers without nulls; published counts, unit counts and sums with lo >= 0 nonnegative;
  quantile values among the public candidates; means within the clamp or null (never NaN);
- `gls_variance` equal to the variance recomputed from the plan.
Across published tables, what the post-processing steps state: every hierarchy level adds up to the level
above; the tables of a marginals query have the same unit totals, equal to the hierarchy's totals of
that geography level where the steps take them from it; on the joint path, shared margins agree.
`recompute` re-runs the post-processing from measurements/ and demands identical published values.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dprelease.transforms.domains import NATION, GeographyDomain

from .debiased import ESTIMATE, RESPONSE_VARIANCE, VARIANCE, DebiasedTable, debiased_columns, debiased_parts, debiased_tables
from .plan import MeanOutput, Plan, TablePlan
from .postprocessing import EstimateVariances, mean_values, post_process, marginals_path
from .layout import MEASUREMENTS_DIR, TABLES_DIR, Layout, Part, mean_parts, table_parts
from .release import GLS_VARIANCE, row_labels
from .storage import UnsafeFile, buffer_inside

MAX_ROW_BYTES = 4096
from .spec import HierarchyQuery, MarginalsQuery


@dataclass(frozen=True)
class FileShape:
    """The columns (name, type) and rows a table file must have."""

    columns: tuple[tuple[str, pa.DataType], ...]
    rows: int

    @property
    def schema(self) -> pa.Schema:
        return pa.schema(list(self.columns))

    @property
    def max_bytes(self) -> int:
        """The largest file of this shape read (labels, values and CSV quoting per row, generously)."""
        return self.rows * MAX_ROW_BYTES + (1 << 20)


def table_shape(table: TablePlan, folder: str, with_variance: bool) -> FileShape:
    """The file shape of a table in `folder`; `with_variance`: published count tables carry gls_variance."""
    columns = [(d.output_name, pa.string()) for d in table.dims]
    if table.quantiles:
        columns.append(("q", pa.float64()))
    value = table.value_name if folder == TABLES_DIR else f"noisy_{table.value_name}"
    columns.append((value, pa.int64()))
    if folder == TABLES_DIR and with_variance:
        columns.append((GLS_VARIANCE, pa.float64()))
    return FileShape(tuple(columns), table.n_outputs)


def mean_shape(plan: Plan, mean: MeanOutput) -> FileShape:
    table = plan.table(mean.sum_table)
    return FileShape(tuple([(d.output_name, pa.string()) for d in table.dims] + [("mean", pa.float64())]),
                     table.n_cells)


def read_table_file(root: Path, relative: str, shape: FileShape, problems: list[str]) -> pa.Table | None:
    """A table's Parquet file with exactly `shape`'s columns and rows and its CSV twin equal to it; the
    Parquet data when both hold."""
    try:
        parquet = pq.ParquetFile(buffer_inside(root, f"{relative}.parquet", shape.max_bytes))
        schema = parquet.schema_arrow
        found = [(f.name, f.type) for f in schema]
        if found != list(shape.columns) or parquet.metadata.num_rows != shape.rows:
            data = None  # the footer already says it is wrong: never decode the data
        else:
            data = parquet.read()
    except UnsafeFile as error:
        problems.append(f"{relative}.parquet: {error}")
        return None
    except (pa.ArrowException, OSError) as error:
        problems.append(f"{relative}.parquet: cannot be read as Parquet ({type(error).__name__})")
        return None
    if data is None and found == list(shape.columns):
        problems.append(f"{relative}.parquet: {parquet.metadata.num_rows} rows, the public domain has {shape.rows}")
        return None
    if found != list(shape.columns):
        problems.append(f"{relative}.parquet: columns {[f'{n}: {t}' for n, t in found]}, expected exactly "
                        f"{[f'{n}: {t}' for n, t in shape.columns]}")
        return None
    if data.num_rows != shape.rows:
        problems.append(f"{relative}.parquet: {data.num_rows} rows, the public domain has {shape.rows}")
        return None
    data = data.replace_schema_metadata(None)
    csv = _read_csv(root, f"{relative}.csv", shape, problems)
    if csv is not None and not csv.equals(data):
        problems.append(f"{relative}.csv: differs from {relative}.parquet")
    return data


def _read_csv(root: Path, relative: str, shape: FileShape, problems: list[str]) -> pa.Table | None:
    names = [name for name, _ in shape.columns]
    options = pacsv.ConvertOptions(column_types=dict(shape.columns), strings_can_be_null=False, null_values=[""],
                                   include_columns=None)
    try:
        data = pacsv.read_csv(buffer_inside(root, relative, shape.max_bytes), convert_options=options)
    except UnsafeFile as error:
        problems.append(f"{relative}: {error}")
        return None
    except (pa.ArrowException, OSError, ValueError) as error:
        problems.append(f"{relative}: cannot be read as CSV with the expected column types ({type(error).__name__})")
        return None
    if data.column_names != names:
        problems.append(f"{relative}: columns {data.column_names}, expected exactly {names}")
        return None
    return data


def _check_labels(name: str, data: pa.Table, plan: Plan, dims, quantiles, part: Part, problems: list[str]) -> None:
    """A part's label columns (and q) equal the public domain's, in cell order, for its rows."""
    for column, labels in row_labels(plan, dims, quantiles, part.start, part.stop).items():
        if not data.column(column).combine_chunks().equals(labels):
            problems.append(f"{name}: column {column!r} differs from the public domain's labels in cell order"
                            if column != "q" else f"{name}: column 'q' differs from the spec's quantiles in order")


MAX_COUNT = 1 << 40
"""Largest count a published table may hold: far above any population, and sums of such values over a
parent's children stay exact in int64 (an edited 2^63 - 1 would wrap around and add up)."""


def _check_values(name: str, table: TablePlan, folder: str, values: pa.ChunkedArray, problems: list[str]) -> bool:
    """Check a table's values; False when they are unusable for the consistency checks."""
    if values.null_count:
        problems.append(f"{name}: {values.null_count} null value(s)")
        return False
    array = values.to_numpy()
    if table.quantiles:
        if not np.isin(array, np.asarray(table.layout.candidates, dtype=np.int64)).all():
            problems.append(f"{name}: a quantile value that is not one of the public candidates")
        return True
    if folder != TABLES_DIR:
        return True
    nonnegative = table.statistic in ("count", "units") or (table.statistic == "sum" and table.measure.lower >= 0)
    if nonnegative and (array < 0).any():
        problems.append(f"{name}: negative values in a table published nonnegative")
    if table.statistic in ("count", "units") and (array > MAX_COUNT).any():
        problems.append(f"{name}: counts above {MAX_COUNT:,} (no population is that large)")
        return False
    return True


def _check_variance(name: str, data: pa.Table, expected: np.ndarray, problems: list[str]) -> None:
    column = data.column(GLS_VARIANCE)
    if column.null_count or not np.allclose(column.to_numpy(), expected, rtol=1e-6, atol=1e-9):
        problems.append(f"{name}: {GLS_VARIANCE!r} differs from the variance recomputed from the plan")


Usable = set[tuple[str, str]]
"""(table, folder) whose every part passed the checks that make its values usable for the consistency checks."""


def check_table_files(root: Path, plan: Plan, estimate: EstimateVariances | None, layout: Layout,
                      problems: list[str]) -> Usable:
    """Check every table file, one part at a time (memory: a part); returns the tables whose values are
    usable for the consistency checks (which read them again, a range of units at a time)."""
    usable: Usable = set()
    for table in plan.tables:
        variance = estimate if estimate is not None and table.name in estimate.per_cell else None
        for folder in (TABLES_DIR, MEASUREMENTS_DIR):
            checked = [_check_part(root, plan, table, folder, part, variance, problems)
                       for part in table_parts(plan, table, folder, layout)]
            if all(checked):
                usable.add((table.name, folder))
    for mean in plan.means:
        for part in mean_parts(plan, mean, layout):
            _check_mean_file(root, plan, mean, part, problems)
    for debiased in debiased_tables(plan):
        noisy = TableRows(root, plan, debiased.table, MEASUREMENTS_DIR, layout) \
            if (debiased.table.name, MEASUREMENTS_DIR) in usable else None
        for part in debiased_parts(plan, debiased, layout):
            _check_debiased_part(root, plan, debiased, part, noisy, problems)
    return usable


def _check_part(root: Path, plan: Plan, table: TablePlan, folder: str, part: Part, estimate: EstimateVariances | None,
                problems) -> bool:
    """One part of a table: its files, labels, values and (published count tables) variances; whether its
    values are usable for the consistency checks."""
    rows = part.stop - part.start
    shape = table_shape(table, folder, estimate is not None)
    shape = FileShape(shape.columns, rows)
    data = read_table_file(root, part.stem, shape, problems)
    if data is None:
        return False
    _check_labels(part.stem, data, plan, table.dims, table.quantiles, part, problems)
    values = data.column(shape.columns[len(table.dims) + bool(table.quantiles)][0])
    usable = _check_values(part.stem, table, folder, values, problems)
    if folder == TABLES_DIR and estimate is not None:
        _check_variance(part.stem, data, estimate.cells(table.name, part.start, part.stop), problems)
    return usable


class TableRows:
    """Rows [start, stop) of a table's value column, read from its part files (the last part read is kept):
    the consistency checks read a range of units at a time, never a whole table. Only for tables whose
    parts passed `check_table_files`."""

    def __init__(self, root: Path, plan: Plan, table: TablePlan, folder: str, layout: Layout):
        self.root, self.folder = root, folder
        self.parts = table_parts(plan, table, folder, layout)
        self.starts = np.asarray([p.start for p in self.parts])
        self.value = table.value_name if folder == TABLES_DIR else f"noisy_{table.value_name}"
        self._cached: tuple[int, np.ndarray] | None = None

    def _part(self, index: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != index:
            part = self.parts[index]
            bound = FileShape((), part.stop - part.start).max_bytes
            table = pq.read_table(buffer_inside(self.root, f"{part.stem}.parquet", bound), columns=[self.value])
            self._cached = (index, table.column(0).to_numpy())
        return self._cached[1]

    def rows(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            part = self.parts[index]
            taken = self._part(index)[start - part.start:min(stop, part.stop) - part.start]
            pieces.append(taken)
            start += taken.size
            index += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, np.int64)


def _check_mean_file(root: Path, plan: Plan, mean: MeanOutput, part: Part, problems: list[str]) -> None:
    name = part.stem
    data = read_table_file(root, name, FileShape(mean_shape(plan, mean).columns, part.stop - part.start), problems)
    if data is None:
        return
    _check_labels(name, data, plan, plan.table(mean.sum_table).dims, (), part, problems)
    column = data.column("mean")
    if pc.any(pc.is_nan(column).fill_null(False)).as_py():
        problems.append(f"{name}: NaN means (a mean without a noisy count of at least 1 is null, never NaN)")
    finite = column.drop_null().to_numpy()
    finite = finite[~np.isnan(finite)]
    if ((finite < mean.measure.lower) | (finite > mean.measure.upper)).any():
        problems.append(f"{name}: means outside the clamp [{mean.measure.lower}, {mean.measure.upper}]")


def debiased_shape(debiased: DebiasedTable, rows: int) -> FileShape:
    labels = [(d.output_name, pa.string()) for d in debiased.table.dims]
    return FileShape(tuple(labels + [(name, pa.float64()) for name in (ESTIMATE, VARIANCE, RESPONSE_VARIANCE)]), rows)


def _check_debiased_part(root: Path, plan: Plan, debiased: DebiasedTable, part: Part, noisy: "TableRows | None",
                         problems: list[str]) -> None:
    """A part of debiased/<table>: its shape and labels, and its values recomputed from the same rows of the
    table's measurement (always: a linear pass over the part)."""
    data = read_table_file(root, part.stem, debiased_shape(debiased, part.stop - part.start), problems)
    if data is None:
        return
    _check_labels(part.stem, data, plan, debiased.table.dims, (), part, problems)
    if noisy is None:
        problems.append(f"{part.stem}: cannot be recomputed (its table's measurement is unusable, see above)")
        return
    expected = debiased_columns(debiased, noisy.rows(part.start, part.stop))
    for name, values in expected.items():
        column = data.column(name)
        if column.null_count or not np.allclose(column.to_numpy(), values.to_numpy(), rtol=1e-9, atol=1e-9):
            problems.append(f"{part.stem}: {name!r} differs from the debiasing of {MEASUREMENTS_DIR}/"
                            f"{debiased.table.name} (recomputed)")


# ---- consistency of the published tables --------------------------------------------------------------------------

CHUNK_CELLS = 1 << 22
"""Cells of a table the consistency checks hold at a time (a range of whole units; whole sibling sets)."""


def unit_chunks(units: int, cells_per_unit: int, parent: np.ndarray | None = None,
                chunk_cells: int = CHUNK_CELLS):
    """Ranges [a, b) of units of about `chunk_cells` cells, never splitting the children of a parent."""
    step = max(1, chunk_cells // max(1, cells_per_unit))
    start = 0
    while start < units:
        stop = min(start + step, units)
        if parent is not None:
            while stop < units and parent[stop] == parent[stop - 1]:
                stop += 1
        yield start, stop
        start = stop


def check_consistency(root: Path, plan: Plan, usable: Usable, layout: Layout, problems: list[str]) -> None:
    """What the post-processing steps state about the published tables, checked on their values, a range of
    units at a time (memory bounded by `CHUNK_CELLS`, not by the release)."""
    readers = {t.name: TableRows(root, plan, t, TABLES_DIR, layout) for t in plan.tables
               if (t.name, TABLES_DIR) in usable}
    totals: dict[tuple[str, str], TableRows] = {}
    for query in plan.spec.queries:
        if isinstance(query, HierarchyQuery):
            _check_hierarchy(plan, query, readers, totals, problems)
    for query in plan.spec.queries:
        if isinstance(query, MarginalsQuery):
            _check_marginals(plan, query, readers, totals, problems)


def _check_hierarchy(plan: Plan, query: HierarchyQuery, readers: dict[str, TableRows], totals, problems) -> None:
    geo = plan.domains[query.geography]
    tables = [t for t in plan.tables if t.query == query.name]
    if not all(t.name in readers for t in tables):
        return
    for i, table in enumerate(tables):
        units = table.dims[0].size
        if not query.by:
            totals.setdefault((query.geography, query.levels[i]), readers[table.name])
        if i == 0:
            continue
        parent_table = tables[i - 1]
        per_unit = table.n_cells // units
        mapping = geo.parent_of(query.levels[i], query.levels[i - 1]) if query.levels[i - 1] != NATION \
            else np.zeros(units, dtype=np.int64)
        differ = 0
        for a, b in unit_chunks(units, per_unit, mapping):
            first, last = int(mapping[a]), int(mapping[b - 1]) + 1
            values = readers[table.name].rows(a * per_unit, b * per_unit).reshape(b - a, per_unit)
            parents = readers[parent_table.name].rows(first * per_unit, last * per_unit).reshape(last - first, per_unit)
            sums = np.zeros_like(parents)
            np.add.at(sums, mapping[a:b] - first, values)
            differ += int(np.count_nonzero(sums != parents))
        if differ:
            problems.append(f"{TABLES_DIR}/{table.name}: does not add up to {parent_table.name} "
                            f"({differ} parent cell(s) differ)")


def _check_marginals(plan: Plan, query: MarginalsQuery, readers: dict[str, TableRows], totals, problems) -> None:
    tables = [t for t in plan.tables if t.query == query.name]
    if not all(t.name in readers for t in tables):
        return
    offset = 1 if query.within else 0
    units = tables[0].dims[0].size if query.within else 1
    shapes = {t.name: tuple(d.size for d in t.dims[offset:]) for t in tables}
    per_unit = {t.name: t.n_cells // units for t in tables}
    column, _, level = (query.within or f"{NATION}.{NATION}").partition(".")
    source = totals.get((column, level)) if query.within else next(
        (reader for (g, lvl), reader in totals.items() if lvl == NATION), None)
    if source is not None and not _unit_rows(source, units):
        source = None
    adding_up = ("joint", "tree", "junction", "model", "converged_model")  # each publishes tables that add up
    joint = marginals_path(plan, query) in adding_up
    labels = {t.name: [d.label for d in t.dims[offset:]] for t in tables}
    first = tables[0].name
    found: set[str] = set()
    for a, b in unit_chunks(units, max(per_unit.values())):
        arrays = {t.name: readers[t.name].rows(a * per_unit[t.name], b * per_unit[t.name])
                  .reshape((b - a,) + shapes[t.name]) for t in tables}
        unit_totals = {name: array.reshape(b - a, -1).sum(axis=1) for name, array in arrays.items()}
        for t in tables[1:]:
            if not np.array_equal(unit_totals[t.name], unit_totals[first]):
                found.add(f"{TABLES_DIR}/{t.name}: its unit totals differ from {first}'s")
        if source is not None and not np.array_equal(unit_totals[first], source.rows(a, b)):
            found.add(f"{TABLES_DIR}/{first}: its unit totals differ from the hierarchy's {level} totals")
        if not joint:
            continue
        for x, y in itertools.combinations(tables, 2):
            shared = [label for label in labels[x.name] if label in labels[y.name]]
            if shared and not np.array_equal(_margin(arrays[x.name], labels[x.name], shared),
                                             _margin(arrays[y.name], labels[y.name], shared)):
                found.add(f"{TABLES_DIR}/{x.name} and {y.name}: their shared margin over {shared} differs "
                          "(the joint, tree, junction and model paths publish tables that add up)")
    problems.extend(sorted(found))


def _unit_rows(reader: TableRows, units: int) -> bool:
    """Whether a hierarchy table has one row per unit of the marginals' level (no `by`)."""
    return reader.parts[-1].stop == units


def _margin(array: np.ndarray, labels: list[str], shared: list[str]) -> np.ndarray:
    drop = tuple(1 + i for i, x in enumerate(labels) if x not in shared)
    kept = [x for x in labels if x in shared]
    margin = array.sum(axis=drop)
    return np.moveaxis(margin, [1 + kept.index(x) for x in shared], list(range(1, 1 + len(shared))))


# ---- recompute ---------------------------------------------------------------------------------------------------

def check_recomputed(root: Path, plan: Plan, usable: Usable, layout: Layout, problems: list[str]) -> None:
    """Re-run the post-processing from the published measurements and demand the published values exactly.
    Holds the whole release in memory (as a run on the embedded engine does). The estimate is floating
    point: a release made on another CPU or numpy/BLAS build, or by a dprelease whose fit kernels differ (the
    joint fit moved from numpy to C on 2026-11-29), could differ in a rounding tie; a difference is reported as
    such."""
    if not all((t.name, MEASUREMENTS_DIR) in usable for t in plan.tables):
        problems.append("--recompute: the measurements could not all be read (see above)")
        return
    noisy = {t.name: TableRows(root, plan, t, MEASUREMENTS_DIR, layout).rows(0, t.n_outputs) for t in plan.tables}
    published = {t.name: TableRows(root, plan, t, TABLES_DIR, layout).rows(0, t.n_outputs) for t in plan.tables
                 if (t.name, TABLES_DIR) in usable}
    again = post_process(plan, noisy)
    for table in plan.tables:
        if table.name in published and not np.array_equal(again[table.name], published[table.name]):
            count = int(np.count_nonzero(again[table.name] != published[table.name]))
            problems.append(f"{TABLES_DIR}/{table.name}: {count} cell(s) differ from the post-processing of "
                            f"{MEASUREMENTS_DIR}/ (recomputed)")
    _check_replayed_units(plan, noisy, problems)
    for mean in plan.means:
        expected = mean_values(mean, noisy)
        for part in mean_parts(plan, mean, layout):
            try:
                shape = FileShape(mean_shape(plan, mean).columns, part.stop - part.start)
                column = pq.read_table(buffer_inside(root, f"{part.stem}.parquet", shape.max_bytes)).column("mean")
            except (UnsafeFile, pa.ArrowException, OSError, KeyError):
                continue
            found = column.to_numpy(zero_copy_only=False).astype(np.float64)
            if not np.array_equal(expected[part.start:part.stop], found, equal_nan=True):
                problems.append(f"{part.stem}: differs from the noisy sum / noisy count (recomputed)")


def _check_replayed_units(plan: Plan, noisy: dict[str, np.ndarray], problems: list[str]) -> None:
    """Every annealed `select: aim` selection's rounds' budget units decided again from the published measurements
    (`selection.replay_units`), against the manifest's."""
    from .selection import replay_units

    for selection in plan.selections:
        if selection.annealing:
            again = replay_units(plan, selection, noisy)
            if again != selection.units:
                problems.append(f"selections: {selection.query}: the rounds' budget units decided again from "
                                f"{MEASUREMENTS_DIR}/ are {list(again)}, but the manifest says {list(selection.units)} "
                                f"(recomputed; another CPU or numpy build can decide a tie differently)")


__all__ = ["check_table_files", "check_consistency", "check_recomputed", "table_shape", "GeographyDomain"]

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

from dprelease.transforms.aggregate import unravel_cells
from dprelease.transforms.domains import NATION, GeographyDomain, dimension_labels

from .plan import MeanOutput, Plan, TablePlan
from .postprocessing import EstimateVariances, mean_values, post_process, uses_joint
from .layout import MEASUREMENTS_DIR, TABLES_DIR, Layout, Part, mean_parts, table_parts
from .release import GLS_VARIANCE, row_labels
from .safe_files import UnsafeFile, buffer_inside

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


def check_table_files(root: Path, plan: Plan, estimate: EstimateVariances | None, layout: Layout,
                      problems: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Check every table file, one part at a time; returns (published values, noisy measurements) of the
    tables read cleanly (for the consistency checks and --recompute)."""
    per_cell = estimate.per_cell if estimate is not None else {}
    published: dict[str, np.ndarray] = {}
    noisy: dict[str, np.ndarray] = {}
    for table in plan.tables:
        for folder, into in ((TABLES_DIR, published), (MEASUREMENTS_DIR, noisy)):
            pieces = []
            for part in table_parts(plan, table, folder, layout):
                values = _check_part(root, plan, table, folder, part, per_cell.get(table.name), problems)
                pieces.append(values)
            if pieces and all(p is not None for p in pieces):
                into[table.name] = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    for mean in plan.means:
        for part in mean_parts(plan, mean, layout):
            _check_mean_file(root, plan, mean, part, problems)
    return published, noisy


def _check_part(root: Path, plan: Plan, table: TablePlan, folder: str, part: Part, variance, problems) -> np.ndarray | None:
    """One part of a table: its files, labels, values and (published count tables) variances; its values
    when they are usable for the consistency checks."""
    rows = part.stop - part.start
    shape = table_shape(table, folder, variance is not None)
    shape = FileShape(shape.columns, rows)
    data = read_table_file(root, part.stem, shape, problems)
    if data is None:
        return None
    _check_labels(part.stem, data, plan, table.dims, table.quantiles, part, problems)
    values = data.column(shape.columns[len(table.dims) + bool(table.quantiles)][0])
    usable = _check_values(part.stem, table, folder, values, problems)
    if folder == TABLES_DIR and variance is not None:
        _check_variance(part.stem, data, variance[part.start:part.stop], problems)
    return values.to_numpy() if usable else None


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


# ---- consistency of the published tables --------------------------------------------------------------------------

def check_consistency(plan: Plan, published: dict[str, np.ndarray], problems: list[str]) -> None:
    """What the post-processing steps state about the published tables, checked on their values."""
    totals: dict[tuple[str, str], np.ndarray] = {}
    for query in plan.spec.queries:
        if isinstance(query, HierarchyQuery):
            _check_hierarchy(plan, query, published, totals, problems)
    for query in plan.spec.queries:
        if isinstance(query, MarginalsQuery):
            _check_marginals(plan, query, published, totals, problems)


def _check_hierarchy(plan: Plan, query: HierarchyQuery, published, totals, problems: list[str]) -> None:
    geo = plan.domains[query.geography]
    tables = [t for t in plan.tables if t.query == query.name]
    if not all(t.name in published for t in tables):
        return
    for i, table in enumerate(tables):
        units = table.dims[0].size
        values = published[table.name].reshape(units, -1)
        if not query.by:
            totals.setdefault((query.geography, query.levels[i]), values.ravel())
        if i == 0:
            continue
        parent_table = tables[i - 1]
        parent = published[parent_table.name].reshape(parent_table.dims[0].size, -1)
        mapping = geo.parent_of(query.levels[i], query.levels[i - 1]) if query.levels[i - 1] != NATION \
            else np.zeros(units, dtype=np.int64)
        sums = np.zeros_like(parent)
        np.add.at(sums, mapping, values)
        if not np.array_equal(sums, parent):
            problems.append(f"{TABLES_DIR}/{table.name}: does not add up to {parent_table.name} "
                            f"({int(np.count_nonzero(sums != parent))} parent cell(s) differ)")


def _check_marginals(plan: Plan, query: MarginalsQuery, published, totals, problems: list[str]) -> None:
    tables = [t for t in plan.tables if t.query == query.name]
    if not all(t.name in published for t in tables):
        return
    offset = 1 if query.within else 0
    units = tables[0].dims[0].size if query.within else 1
    shapes = {t.name: (units,) + tuple(d.size for d in t.dims[offset:]) for t in tables}
    arrays = {t.name: published[t.name].reshape(shapes[t.name]) for t in tables}
    unit_totals = {name: a.reshape(units, -1).sum(axis=1) for name, a in arrays.items()}
    first = tables[0].name
    for t in tables[1:]:
        if not np.array_equal(unit_totals[t.name], unit_totals[first]):
            problems.append(f"{TABLES_DIR}/{t.name}: its unit totals differ from {first}'s")
    column, _, level = (query.within or f"{NATION}.{NATION}").partition(".")
    source = totals.get((column, level)) if query.within else next(
        (v for (g, lvl), v in totals.items() if lvl == NATION), None)
    if source is not None and source.size == units and not np.array_equal(unit_totals[first], source):
        problems.append(f"{TABLES_DIR}/{first}: its unit totals differ from the hierarchy's {level} totals")
    if not uses_joint(plan, query):
        return
    labels = {t.name: [d.label for d in t.dims[offset:]] for t in tables}
    for a, b in itertools.combinations(tables, 2):
        shared = [x for x in labels[a.name] if x in labels[b.name]]
        if shared and not np.array_equal(_margin(arrays[a.name], labels[a.name], shared),
                                         _margin(arrays[b.name], labels[b.name], shared)):
            problems.append(f"{TABLES_DIR}/{a.name} and {b.name}: their shared margin over {shared} differs "
                            "(the joint path publishes margins of one joint table)")


def _margin(array: np.ndarray, labels: list[str], shared: list[str]) -> np.ndarray:
    drop = tuple(1 + i for i, x in enumerate(labels) if x not in shared)
    kept = [x for x in labels if x in shared]
    margin = array.sum(axis=drop)
    return np.moveaxis(margin, [1 + kept.index(x) for x in shared], list(range(1, 1 + len(shared))))


# ---- recompute ---------------------------------------------------------------------------------------------------

def check_recomputed(root: Path, plan: Plan, published: dict[str, np.ndarray], noisy: dict[str, np.ndarray],
                     layout: Layout, problems: list[str]) -> None:
    """Re-run the post-processing from the published measurements and demand the published values exactly.
    The estimate is floating point: a release made on another CPU or numpy/BLAS build could differ in a
    rounding tie; a difference is reported as such."""
    if len(noisy) != len(plan.tables):
        problems.append("--recompute: the measurements could not all be read (see above)")
        return
    again = post_process(plan, noisy)
    for table in plan.tables:
        if table.name in published and not np.array_equal(again[table.name], published[table.name]):
            count = int(np.count_nonzero(again[table.name] != published[table.name]))
            problems.append(f"{TABLES_DIR}/{table.name}: {count} cell(s) differ from the post-processing of "
                            f"{MEASUREMENTS_DIR}/ (recomputed)")
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


__all__ = ["check_table_files", "check_consistency", "check_recomputed", "table_shape", "GeographyDomain"]

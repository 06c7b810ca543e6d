"""One composite Beam PTransform for a whole release inside a user's pipeline: `PublishedTables`.

    records (Arrow tables / record batches, or dicts)
      -> RecordsToBatches     dicts batched into Arrow tables (Arrow passes through)
      -> EncodeRecords        public-domain codes, invalid values by policy
      -> BoundContributions   at most k records per unit (records pass through without a privacy unit)
      -> CountCells           sparse counts, sums, unit counts, quantile buckets per table
      -> AddNoise             exact integer noise / exponential-mechanism selections per public cell range
      -> post-processing      the release's consistency step, as `dprelease run` applies it
      -> (table name, pa.Table)  every published table (counts with `gls_variance`), means included

Privacy: the noise is a pure function of the key bound to (dataset, release, plan fingerprint, "beam-pipeline-
input"), and the key is drawn from the OS by one worker each time the pipeline runs (`ExecutionKey`: a Create of
nothing, mapped to a fresh key, handed to the bounding and noise steps as a singleton side input). So no key is
in the pipeline graph, a template or a pickled DoFn, and running one pipeline object twice, a template, or a
scheduled job built once, draws independent noise every time: two outputs never share noise, so their
difference is never the exact difference of two inputs. A runner keeps the side input as it keeps any data in
flight (its shuffle or temporary storage): as private as the input. Nothing can be re-run for free, nothing is
reused. Post-processing touches noisy values only. Budget accounting, the manifest and `verify` belong to the
launcher path
(`dprelease run --engine beam`, or `dprelease.Release.run`), which also post-processes per geographic unit
in the workers; this transform gathers the noisy tables on one worker for post-processing, so it is for
releases that fit one worker's memory (`max_cells`, default the embedded engine's cell limit, is checked
when the transform is built).
"""
from __future__ import annotations

from typing import Any, Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa

from .beam import AddNoise, BoundContributions, CountCells, EncodeRecords
from .csprng import ReleaseKey
from .worker_errors import public_failures

PIPELINE_INPUT = "beam-pipeline-input"
"""What the key is bound to in place of the input's fingerprint (a PCollection has no bytes to hash)."""


class RecordsToBatches(beam.PTransform):
    """Elements that are dicts (one record each) -> Arrow tables of up to `batch_size` records; Arrow tables
    and record batches pass through as tables. Column batches are what every later step works on."""

    def __init__(self, columns: list[str], batch_size: int = 65_536, unit: str | None = None):
        """`columns`: the fields taken from each dict (a missing one is null: an invalid value, handled by the
        column's policy, never an error); `unit`: the privacy unit's field, always read as text."""
        super().__init__()
        self.columns, self.batch_size, self.unit = list(columns), batch_size, unit

    def expand(self, records):
        def split(element) -> Iterable[tuple[str, Any]]:
            if isinstance(element, pa.Table):
                yield "arrow", element
            elif isinstance(element, pa.RecordBatch):
                yield "arrow", pa.Table.from_batches([element])
            elif isinstance(element, dict):
                yield "dict", element
            else:
                raise TypeError(f"PublishedTables: elements must be dicts or Arrow tables/record batches, "
                                f"not {type(element).__name__}")

        tagged = records | "Tag" >> beam.FlatMap(public_failures("read records", split))
        arrow = tagged | "Arrow" >> beam.Filter(lambda e: e[0] == "arrow") | "Tables" >> beam.Map(lambda e: e[1])
        batched = (tagged | "Dicts" >> beam.Filter(lambda e: e[0] == "dict") | "Records" >> beam.Map(lambda e: e[1])
                   | "Batch" >> beam.BatchElements(min_batch_size=1, max_batch_size=self.batch_size)
                   | "ToArrow" >> beam.Map(public_failures("batch records", _table_of_records), self.columns,
                                           self.unit))
        return (arrow, batched) | "AllBatches" >> beam.Flatten()


def _text(value) -> str | None:
    """A value as text; None stays null, and so does text that is not valid Unicode (a lone surrogate): an
    invalid value for the column's policy, never an error."""
    if value is None:
        return None
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return text


def _table_of_records(records: list[dict], columns: list[str], unit: str | None = None) -> pa.Table:
    """Records -> a table of `columns`. A column whose values Arrow cannot hold in one type is taken as text
    (`_text`), and the privacy unit always is (so every batch's unit column has one type, whatever its values):
    the encoder then applies the column's policy to what is invalid, so no value can make the pipeline fail (or
    an error quote it)."""
    arrays = {}
    for name in columns:
        values = [record.get(name) for record in records]
        try:
            if name == unit:
                raise TypeError("the unit is always text")
            array = pa.array(values)
            if pa.types.is_nested(array.type) or pa.types.is_binary(array.type):
                raise TypeError("not a scalar column")
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            array = pa.array([_text(v) for v in values], type=pa.string())
        arrays[name] = array
    return pa.table(arrays)


def draw_execution_key(_, plan) -> ReleaseKey:
    """A fresh key from the OS, bound to the plan's release: called by one worker when the pipeline runs."""
    return _bound(plan, ReleaseKey.generate(), PIPELINE_INPUT)


class ExecutionKey(beam.PTransform):
    """pipeline -> a PCollection of one key, drawn when the pipeline runs (never when it is built)."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def expand(self, pipeline):
        return pipeline | "Nothing" >> beam.Create([None]) | "Draw" >> beam.Map(draw_execution_key, self.plan)


class PublishedTables(beam.PTransform):
    """Records -> (table name, pa.Table) for every published table of a release spec (see the module's
    docstring for the steps and the privacy contract)."""

    def __init__(self, plan, max_cells: int | None = None):
        """`plan`: the release's plan (`dprelease.Release.build_plan()`). The key is drawn per execution, so the
        transform takes none: a release that must be reproducible, accounted and verified is run by the launcher
        (`dprelease run --engine beam`)."""
        super().__init__()
        from dprelease.pipelines.limits import check_plan_limits

        check_plan_limits(plan, max_cells, "embedded")
        if plan.selections:
            from dprelease.accounting.errors import SpecError

            raise SpecError(f"queries {[s.query for s in plan.selections]}: `select: mst` chooses its tables from "
                            "the data before measuring them; run it with `dprelease run --engine embedded`")
        self.plan = plan

    @classmethod
    def from_spec(cls, spec, max_cells: int | None = None) -> "PublishedTables":
        """From a spec file path or a `dprelease.Release`."""
        from dprelease.pipelines.api import Release

        release = spec if isinstance(spec, Release) else Release.from_yaml(spec)
        return cls(release.build_plan(), max_cells)

    def expand(self, records):
        plan = self.plan
        key = records.pipeline | "ExecutionKey" >> ExecutionKey(plan)
        columns = plan.input_columns()
        encoded = (records | "Batches" >> RecordsToBatches(columns, unit=plan.spec.privacy_unit)
                   | "Columns" >> beam.Map(public_failures("select columns", _columns), columns, plan.spec.privacy_unit)
                   | "Encode" >> EncodeRecords.from_plan(plan)
                   | "Bound" >> BoundContributions.from_plan(plan, key))
        noisy = (encoded | "Count" >> CountCells([t.layout for t in plan.tables])
                 | "AddNoise" >> AddNoise.from_plan(plan, key))
        return (noisy | "Gather" >> beam.combiners.ToList()
                | "PostProcess" >> beam.FlatMap(public_failures("post-process", _published_tables), plan))


def _bound(plan, key: ReleaseKey, input_binding: str) -> ReleaseKey:
    from dprelease.pipelines.manifest import plan_fingerprint

    spec = plan.spec
    return key.bind(spec.dataset_id, spec.release_id, plan_fingerprint(plan), input_binding)


def _columns(table: pa.Table, names: list[str], unit: str | None = None) -> pa.Table:
    """The spec's columns of a batch; the privacy unit as text whatever its type in this batch (batches are
    bounded together: their unit columns must have one type)."""
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise ValueError(f"PublishedTables: records lack column(s) {missing} of the spec")
    table = table.select(names)
    if unit is not None and not pa.types.is_string(table.schema.field(unit).type):
        column = table.column(unit)
        text = pa.array([_text(v) for v in column.to_pylist()], type=pa.string())
        table = table.set_column(table.schema.get_field_index(unit), unit, text)
    return table


def _published_tables(ranges: list, plan) -> Iterable[tuple[str, pa.Table]]:
    """Every noisy range -> every published table: post-processing (estimate, integer step) exactly as the
    launcher applies it, then the tables as `dprelease run` writes them (labels, value, `gls_variance`)."""
    from dprelease.pipelines.postprocessing import estimate_variances, post_process
    from dprelease.pipelines.release import mean_column, rows_frame, table_frame

    noisy = {t.name: np.zeros(t.n_outputs, dtype=np.int64) for t in plan.tables}
    for name, start, values in ranges:
        noisy[name][start:start + values.size] = values
    published = post_process(plan, noisy)
    estimate = estimate_variances(plan)
    for table in plan.tables:
        variance = estimate.cells(table.name, 0, table.n_outputs) if table.name in estimate.per_cell else None
        yield table.name, table_frame(plan, table, published[table.name], table.value_name, variance)
    for mean in plan.means:
        dims = plan.table(mean.sum_table).dims
        yield mean.name, rows_frame(plan, dims, (), 0, plan.table(mean.sum_table).n_outputs, mean_column(mean, noisy))

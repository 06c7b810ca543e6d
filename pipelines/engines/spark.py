"""The Spark engine: the same kernels as the embedded engine, run by Spark executors.

    read (Spark Parquet/CSV) -> drop null units, shuffle by privacy unit (JVM)
    -> per partition: encode, bound, measure (mapInArrow: the encoding, bounding and aggregation
       kernels, emitting sparse partial measurements: counts, sums, unit counts, quantile buckets)
    -> sum partials (Spark groupBy) -> release per (table, cell range) on the executors
       (applyInArrow: noise or quantile selection kernel; every public cell, empty ones included)
    -> the driver receives only released values (per public cell, or per cell and q), never row-level data.

Because bounding sees all records of a unit in one partition and the noise of a cell is a
pure function of (key, table, cell), the result is bit-identical to the embedded engine's,
and a retried task redraws exactly the same values. The release key travels to executors
inside the task closures: enable Spark's RPC authentication and encryption on shared
clusters (see deploy/spark/README.md).
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow as pa

from dprelease.accounting.errors import DPReleaseError, InputSchemaError, SpecError
from dprelease.transforms.aggregate import bounded_counts
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.encode import ColumnEncoder, encode_batch
from dprelease.transforms.release_values import noisy_range
from dprelease.transforms.samplers import FAIL_FIRST_ATTEMPT_ENV

from ..plan import Plan
from ..source import InputSource, value_type
from .base import Engine, ProgressHook, no_progress

NOISE_RANGE_CELLS = 1 << 18
ROWS_PER_PARTITION = 2_000_000
ARROW_BATCH_ROWS = 1 << 19
"""Rows per Arrow batch handed to the kernels (Spark's default, 10,000, costs a kernel call per 10k rows)."""


def _plain_schema(schema: pa.Schema, columns: list[str]) -> pa.Schema:
    """`columns` of a file schema with dictionary types replaced by their value types (as Spark reads them)."""
    return pa.schema([pa.field(c, value_type(schema.field(c).type)) for c in columns])


def _import_pyspark():
    try:
        import pandas  # noqa: F401 - pyspark's Arrow paths need it
        import pyspark  # noqa: F401
        from pyspark.sql import SparkSession
    except ImportError as error:
        raise SpecError(f"--engine spark needs pyspark and pandas ({error.name} is missing): "
                        "pip install \"dprelease[spark]\"") from None
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise SpecError("--engine spark needs a Java runtime (17 or newer) on PATH or in JAVA_HOME")
    return SparkSession


def _encode_bound_count_function(plan: Plan, unit: str | None, subkey: bytes):
    """Per partition (all records of a unit together): encode every batch (encoding kernel),
    bound contributions (bounding kernel) and measure every table (aggregation kernel); emit the
    nonzero entries as sparse partial counts, each with the release range it falls in."""
    columns = plan.encoded_columns()
    encoders = {c: ColumnEncoder(plan.domains[c]) for c in columns}
    sizes = [plan.domains[c].size for c in columns]
    layouts = [t.layout for t in plan.tables]
    steps = [t.release.range_length(NOISE_RANGE_CELLS) for t in plan.tables]

    def encode_bound_count(batches):
        parts: dict[str, list] = {c: [] for c in columns}
        units = []
        for batch in batches:
            codes, keep = encode_batch(batch, encoders)  # reads each encoder's source column
            for c in columns:
                parts[c].append(codes[c][keep].astype(np.int32))
            if unit:
                units.append(batch.column(unit).filter(pa.array(keep)))
        if not units and not any(parts.values()):
            return
        codes = {c: np.concatenate(v) if v else np.empty(0, np.int32) for c, v in parts.items()}
        unit_values = pa.chunked_array(units).combine_chunks() if unit else None
        partial = bounded_counts(layouts, codes, sizes, unit_values, plan.bounds.max_records_per_unit, subkey)
        for table_id, counts in enumerate(partial):
            cells = np.flatnonzero(counts)
            yield pa.RecordBatch.from_pydict({
                "table_id": pa.array(np.full(cells.size, table_id, dtype=np.int32)),
                "range_id": pa.array((cells // steps[table_id]).astype(np.int64)),
                "cell": pa.array(cells.astype(np.int64)),
                "count": pa.array(counts[cells]),
            })

    return encode_bound_count


def _noise_function(plan: Plan, key: ReleaseKey, target: int):
    releases = [t.release for t in plan.tables]
    fail_first_attempt = os.environ.get(FAIL_FIRST_ATTEMPT_ENV) == "noise"

    def noise(group: pa.Table) -> pa.Table:
        if fail_first_attempt:
            from pyspark import TaskContext

            context = TaskContext.get()
            if context is not None and context.attemptNumber() == 0:
                raise RuntimeError("test hook: failing the first attempt of a noise task")
        table_id = int(group.column("table_id")[0].as_py())
        range_id = int(group.column("range_id")[0].as_py())
        release = releases[table_id]
        step = release.range_length(target)
        start, stop = range_id * step, min((range_id + 1) * step, release.n_measured)
        cells = group.column("cell").to_numpy()
        real = cells >= 0  # range markers carry cell -1
        values = noisy_range(key, release, start, stop, cells[real], group.column("count").to_numpy()[real])
        first = release.output_start(start)
        return pa.table({"table_id": pa.array(np.full(values.size, table_id, dtype=np.int32)),
                         "cell": pa.array(np.arange(first, first + values.size, dtype=np.int64)),
                         "noisy": pa.array(values)})

    return noise


class SparkEngine(Engine):
    name = "spark"

    def __init__(self, master: str | None = None, app_name: str = "dprelease"):
        _import_pyspark()  # a missing extra is a public spec error, before any key is drawn or budget reserved
        self.master = master
        self.app_name = app_name

    def session(self):
        SparkSession = _import_pyspark()
        builder = SparkSession.builder.appName(self.app_name)
        if self.master:
            builder = builder.master(self.master)
        elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit, which sets the master
            builder = builder.master("local[*]")
        return (builder.config("spark.sql.execution.arrow.pyspark.enabled", "true")
                .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
                .getOrCreate())

    def check_input_schema(self, source: InputSource) -> None:
        """Spark reads every Parquet file with one schema (the dataset's), converted to Spark types: a
        column type Spark cannot hold (uint64) or a file whose column type differs from the first file's
        would fail mid-job. Both are refused up front, naming the file and the column."""
        if source.format != "parquet":
            return
        _import_pyspark()
        from pyspark.sql.pandas.types import from_arrow_schema

        expected = _plain_schema(source.dataset.schema, source.columns)
        problems = []
        for field in expected:
            try:
                from_arrow_schema(pa.schema([field]))
            except Exception:  # noqa: BLE001 - pyspark raises several types for unsupported types
                problems.append(f"input column {field.name!r}: type {field.type} cannot be read by the spark engine; "
                                "store it as int64 or string, or use the embedded or beam engine")
        for path, schema in source.file_schemas.items():
            found = _plain_schema(schema, source.columns)
            for field, want in zip(found, expected):
                if field.type != want.type:
                    problems.append(f"input file {path}: column {field.name!r} is {field.type}, the first file's is "
                                    f"{want.type}; the spark engine reads every file with one schema")
        if problems:
            raise InputSchemaError(problems)

    def _read(self, spark, source: InputSource):
        files = source.files()
        if source.format == "parquet":
            from pyspark.sql.pandas.types import from_arrow_schema

            plain = _plain_schema(source.dataset.schema, source.columns)
            frame = spark.read.schema(from_arrow_schema(plain)).parquet(*files)
        else:
            frame = spark.read.csv(files, header=True, inferSchema=False, mode="DROPMALFORMED")
        return frame.select(*source.columns)

    def validate_input(self, plan: Plan, source: InputSource, runner):
        """The value-level expectations on a Spark DataFrame, columns in the form the encoder reads
        them (integers as doubles, null when not an integer; codes as text). The session stays up
        for the release job that follows."""
        from pyspark.sql import functions as F

        from dprelease.transforms.domains import IntegerDomain

        from ..validation import ValidationOutcome

        frame = self._read(self.session(), source)
        for name in plan.used_columns():
            if isinstance(plan.domains[name], IntegerDomain):
                number = F.expr(f"try_cast(`{name}` as double)")
                frame = frame.withColumn(name, F.when(number == F.floor(number), number))
            else:
                frame = frame.withColumn(name, F.col(name).cast("string"))
        outcome = ValidationOutcome(runner.expectations)
        try:
            outcome.add(runner.validate(frame, "value"))
        except Exception as error:
            raise DPReleaseError(f"input validation on Spark failed: {type(error).__name__}") from error
        return outcome

    def noisy_measurements(self, plan: Plan, source: InputSource, key: ReleaseKey,
                           progress: ProgressHook = no_progress) -> dict[str, np.ndarray]:
        from pyspark.sql import functions as F

        spark = self.session()
        try:
            unit = source.unit_column
            frame = self._read(spark, source)
            if unit:  # records of a unit must meet in one partition; null units are dropped by policy
                partitions = max(spark.sparkContext.defaultParallelism,
                                 -(-source.estimated_rows() // ROWS_PER_PARTITION))
                frame = frame.where(F.col(unit).isNotNull()).repartition(partitions, unit)
            partial = frame.mapInArrow(_encode_bound_count_function(plan, unit, key.derive("dprelease/bound")),
                                       "table_id int, range_id long, cell long, count long")
            progress("read", 1, 1)
            counts = partial.groupBy("table_id", "range_id", "cell").agg(F.sum("count").alias("count"))
            ranges = [(i, r, -1, 0) for i, t in enumerate(plan.tables)
                      for r in range(len(t.release.range_starts(NOISE_RANGE_CELLS)))]
            markers = spark.createDataFrame(ranges, "table_id int, range_id long, cell long, count long")
            noisy = (counts.select("table_id", "range_id", "cell", "count").unionByName(markers)
                     .groupBy("table_id", "range_id")
                     .applyInArrow(_noise_function(plan, key, NOISE_RANGE_CELLS), "table_id int, cell long, noisy long"))
            result = noisy.toArrow()
            progress("noise", 1, 1)
        except Exception as error:  # Spark wraps executor errors; keep the message public-only
            if isinstance(error, DPReleaseError):
                raise
            raise DPReleaseError(f"the Spark job failed: {type(error).__name__}") from error
        finally:
            spark.stop()
        return self._assemble(plan, result)

    @staticmethod
    def _assemble(plan: Plan, result: pa.Table) -> dict[str, np.ndarray]:
        table_ids = result.column("table_id").to_numpy()
        cells = result.column("cell").to_numpy()
        values = result.column("noisy").to_numpy()
        out = {}
        for i, t in enumerate(plan.tables):
            mine = table_ids == i
            vector = np.zeros(t.n_outputs, dtype=np.int64)
            vector[cells[mine]] = values[mine]
            if np.count_nonzero(mine) != t.n_outputs:
                raise DPReleaseError(f"table {t.name}: the Spark job returned {np.count_nonzero(mine)} of {t.n_outputs} values")
            out[t.name] = vector
        return out

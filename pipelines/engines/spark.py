"""The Spark engine: the same kernels as the embedded engine, run by Spark executors.

    read and encode (mapInArrow over read tasks: pyarrow reads each task's row groups, the encoding kernel
       turns them into small integer codes, records with a null unit are dropped, and each task's records are
       split by a keyed hash of the unit into zstd-compressed Arrow IPC blobs, one per spill partition)
    -> shuffle the blobs by partition (JVM: a few large binary rows, never a row per record)
    -> per partition (all records of a unit together): bound, measure (mapInArrow: the bounding and
       aggregation kernels, emitting sparse partial measurements: counts, sums, unit counts, quantile buckets)
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

import atexit
import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from dprelease.accounting.errors import DPReleaseError, InputSchemaError, SpecError
from dprelease.accounting.redact import shown
from dprelease.transforms.aggregate import bounded_counts, bounded_records, kept_counts
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.bound import shard_pieces, shard_salt, shuffled, unit_shards, unshuffled
from dprelease.transforms.encode import UNIT, ColumnEncoder, encoded_table
from dprelease.transforms.release_values import dense_parts, release_range
from dprelease.transforms.samplers import FAIL_FIRST_ATTEMPT_ENV
from dprelease.transforms.worker_errors import public_failures

from ..plan import Plan
from ..source import InputSource, value_type
from ..storage import InputChanged, read_regular_start
from .base import Engine, ProgressHook, checked_scores, kept_records_signature, no_progress

NOISE_RANGE_CELLS = 1 << 18
ROWS_PER_PARTITION = 2_000_000
ARROW_BATCH_ROWS = 1 << 19
"""Rows per Arrow batch handed to the kernels (Spark's default, 10,000, costs a kernel call per 10k rows)."""


def _worker_function(step: str, function):
    """`function` as an executor runs it: its failures made public (`public_failures`), and on its first call in a
    Python worker the objects then alive (the modules the kernels import) moved out of the cyclic garbage
    collector's reach (`gc.freeze`). PySpark's daemon runs a full collection after every task; it traversed the
    kernels' 110,000 module objects each time (about 50 ms a task)."""
    if inspect.isgeneratorfunction(function):
        @functools.wraps(function)
        def generator(*args, **kwargs):
            _freeze_imports()
            yield from function(*args, **kwargs)
        return public_failures(step, generator)

    @functools.wraps(function)
    def call(*args, **kwargs):
        _freeze_imports()
        return function(*args, **kwargs)
    return public_failures(step, call)


def _freeze_imports() -> None:
    """Once per PySpark worker process: every object now tracked goes to the collector's permanent generation
    (still freed when unreferenced; only a reference cycle among them outlives its use). Elsewhere (a test calling
    the function directly) nothing is frozen."""
    global _IMPORTS_FROZEN
    if not _IMPORTS_FROZEN:
        from pyspark import TaskContext

        if TaskContext.get() is not None:
            gc.freeze()
            _IMPORTS_FROZEN = True


_IMPORTS_FROZEN = False


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


def _encode_shard_function(reader, tasks: list, plan: Plan, unit: str | None, salt: int, partitions: int):
    """Per partition of task numbers: each read task's records (`source.FileReader`: the bytes the key is bound
    to) encoded (the encoding kernel, as the embedded engine encodes them: records it drops and records with a null
    unit left out) and split by a keyed hash of the unit (`unit_shards`, the embedded engine's spill partitions)
    into (part, blob) rows, a blob being an Arrow IPC stream of one batch's records of one part. Without a unit
    every record is its own unit and a task's records form one part."""
    encoders = {c: ColumnEncoder(plan.domains[c]) for c in plan.encoded_columns()}

    def encode_shard(batches):
        for batch in batches:
            for index in batch.column("task").to_pylist():
                for records in reader.batches(tasks[index]):
                    table = encoded_table(records, encoders, unit)
                    if not table.num_rows:
                        continue
                    part = unit_shards(table.column(UNIT), partitions, salt) if unit else \
                        np.full(table.num_rows, index % partitions)
                    yield from _blob_batches((labels[p], blob)
                                             for p, blob in _part_blobs(shard_pieces(table, part, partitions)))

    labels = partition_labels(partitions)
    return _worker_function("read and encode", encode_shard)


LOCAL_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"
"""JVM options of a session this engine starts on a `local` or `local[N]` master (its JVM is driver and executor at
once): the quick (C1) JIT compiler only. The JVM moves Arrow blobs and shuffles them while the kernels run in
Python; the optimising compiler (C2) took most of a core for the session's first seconds (the country release at
10M rows on 2 cores: 25.0 -> 21.5 s; at 40M rows 34.7 -> 30.3 s). Not set when the deployment may set the JVM's
options itself (`_jvm_options_configured`), nor on any other master."""


def _quick_jit_master(master: str | None) -> bool:
    """A master whose one JVM runs the executors too (`local`, `local[N]`, `local[N,F]`, `local[*]`), and that JVM
    not launched yet: under spark-submit (PYSPARK_GATEWAY_PORT set) it already runs, with its options."""
    return master is not None and (master == "local" or master.startswith("local[")) \
        and "PYSPARK_GATEWAY_PORT" not in os.environ


def _jvm_options_configured() -> bool:
    """Whether the deployment may set the driver JVM's options where the engine's `spark.driver.defaultJavaOptions`
    would replace them or be weighed against them: that setting, a properties file or a tiered-compilation flag in
    PYSPARK_SUBMIT_ARGS or the JVM's option variables, or a spark-defaults.conf (SPARK_CONF_DIR, else SPARK_HOME's
    or the installed pyspark's conf/) that names it or is too large to search. Fails towards True: the quick JIT
    is then left out, nothing of the deployment's is replaced."""
    submit = os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    if "spark.driver.defaultJavaOptions" in submit or "--properties-file" in submit:
        return True
    if any("Tiered" in os.environ.get(name, "") for name in ("SPARK_SUBMIT_OPTS", "JAVA_TOOL_OPTIONS",
                                                              "JDK_JAVA_OPTIONS")):
        return True
    return _names_driver_java_options(os.path.join(_spark_conf_directory(), "spark-defaults.conf"))


def _spark_conf_directory() -> str:
    """The directory spark-submit reads spark-defaults.conf from: SPARK_CONF_DIR, else SPARK_HOME/conf, else the
    installed pyspark's (where a pip install's spark-submit finds its home)."""
    if os.environ.get("SPARK_CONF_DIR"):
        return os.environ["SPARK_CONF_DIR"]
    if os.environ.get("SPARK_HOME"):
        return os.path.join(os.environ["SPARK_HOME"], "conf")
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "conf")


def _names_driver_java_options(path: str) -> bool:
    """Whether the file at `path` sets (or may set) `spark.driver.defaultJavaOptions`: read only if a regular file
    (`storage.read_regular_start`: a FIFO or a device in its place is skipped, not waited on); a file larger than
    SPARK_DEFAULTS_BYTES counts as setting it."""
    text = read_regular_start(path, SPARK_DEFAULTS_BYTES + 1)
    return text is not None and (len(text) > SPARK_DEFAULTS_BYTES or b"spark.driver.defaultJavaOptions" in text)


SPARK_DEFAULTS_BYTES = 1 << 20
"""How much of spark-defaults.conf is searched for the driver's JVM options (Spark reads the same file itself)."""


JVM_EXIT_SECONDS = 30
"""How long the end of a process waits for the JVM it launched for Spark to exit before killing it."""


def _end_launched_jvm() -> None:
    """At the end of the process: the JVM it launched for Spark (the driver, and local mode's executors, whose Python
    workers held records and the key) is told to exit (its stdin closed: pyspark's gateway exits on EOF) and waited
    for, so a command returns only once it is gone (otherwise it outlives the command by a few seconds, orphaned);
    killed after JVM_EXIT_SECONDS. A JVM this process did not launch (spark-submit's) is left to its launcher."""
    from pyspark import SparkContext

    process = getattr(SparkContext._gateway, "proc", None)
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(OSError):
        process.stdin.close()
    try:
        process.wait(timeout=JVM_EXIT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@functools.cache
def _end_launched_jvm_at_exit() -> None:
    """Register `_end_launched_jvm` once per process."""
    atexit.register(_end_launched_jvm)


def _murmur3_int(value: int, seed: int = 42) -> int:
    """Spark's hash of an int column (`Murmur3_x86_32.hashInt`, the seed of `hash()` and of hash partitioning),
    as a signed 32-bit int."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = rotl((value & mask) * 0xCC9E2D51 & mask, 15) * 0x1B873593 & mask
    h1 = (rotl(seed ^ k1, 13) * 5 + 0xE6546B64) & mask
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def partition_labels(partitions: int) -> list[int]:
    """For each shard 0 .. partitions-1, the smallest int that Spark's hash partitioning (`repartition(partitions,
    col)`: pmod(hash, partitions)) sends to the partition of the same number: shards labelled so go one to a
    partition (the shards' own numbers collide: two in one task, another task empty). Only the balance depends
    on it: all of a unit's records carry one label whatever the hash, so they meet in one partition."""
    labels: list[int | None] = [None] * partitions
    left, value = partitions, 0
    while left:
        slot = _murmur3_int(value) % partitions
        if labels[slot] is None:
            labels[slot] = value
            left -= 1
        value += 1
    return labels


BLOB_BYTES = 64 << 20
"""Encoded bytes per blob at most (a part's records of one batch are split by rows past it; a single record
larger than this is a blob of its own)."""
BLOBS_BATCH_BYTES = 256 << 20
"""Blob bytes per Arrow batch an executor hands Spark at most (Spark's binary columns have 32-bit offsets: a
batch's blobs must stay below 2 GiB whatever the records' sizes; `ARROW_SETTINGS` caps the batches Spark hands
back the same way)."""


def _part_blobs(pieces: Iterator[tuple[int, pa.Table]]) -> Iterator[tuple[int, bytes]]:
    """(part, blob) for each (part, records) piece of one batch, a piece's records cut into runs of rows of at most
    BLOB_BYTES (a larger record is a blob of its own): which records share a blob never matters (a partition's
    blobs are concatenated)."""
    for part, records in pieces:
        ends = np.cumsum(_row_bytes(records))
        start = 0
        while start < records.num_rows:
            reach = (ends[start - 1] if start else 0) + BLOB_BYTES
            stop = max(start + 1, int(np.searchsorted(ends, reach, side="right")))
            yield part, shuffled(records.slice(start, stop - start))
            start = stop


def _row_bytes(records: pa.Table) -> np.ndarray:
    """Each record's bytes in its columns: fixed-width values, and a variable-width value's length plus its
    offset (the unit's bytes vary by record, and records of large units can sit together)."""
    import pyarrow.compute as pc

    sizes = np.zeros(records.num_rows, dtype=np.int64)
    for column in records.columns:
        kind = column.type
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_string(kind) \
                or pa.types.is_large_string(kind):
            lengths = pc.fill_null(pc.binary_length(column), 0)
            sizes += lengths.to_numpy(zero_copy_only=False).astype(np.int64) + 8
        else:
            sizes += max(1, kind.bit_width // 8) if pa.types.is_primitive(kind) else 8
    return sizes


def _blob_batches(blobs) -> Iterator[pa.RecordBatch]:
    """(part, blob) pairs as Arrow batches of at most BLOBS_BATCH_BYTES of blobs (one blob at least)."""
    parts: list[int] = []
    chunk: list[bytes] = []
    size = 0
    for part, blob in blobs:
        if chunk and size + len(blob) > BLOBS_BATCH_BYTES:
            yield _blob_batch(parts, chunk)
            parts, chunk, size = [], [], 0
        parts.append(part)
        chunk.append(blob)
        size += len(blob)
    if chunk:
        yield _blob_batch(parts, chunk)


def _blob_batch(parts: list[int], blobs: list[bytes]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"part": pa.array(parts, type=pa.int32()), "blob": pa.array(blobs, pa.binary())})


def _blob_records(batches, columns: list[str], unit: str | None):
    """(codes of every column, records, unit values) of one partition's blobs (`_encode_shard_function`: all
    records of a unit together); None for a partition with no record."""
    tables = [unshuffled(blob.as_buffer()) for batch in batches for blob in batch.column("blob")]
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return None
    records = pa.concat_tables(tables)
    codes = {c: records.column(c).to_numpy() for c in columns}
    return codes, records.num_rows, records.column(UNIT) if unit else None


COUNTS_SCHEMA = "table_id int, range_id long, cells binary, counts binary"
"""Partial counts as Spark rows: per (table, release range) a task counted records in, the range's nonzero cells
and their counts (int64 arrays as bytes; a cell repeats across tasks and is summed where the range is released)."""


def _sparse_counts(table_id: int, counts: np.ndarray, steps: list[int]) -> pa.RecordBatch:
    """A table's nonzero counts as partial counts (COUNTS_SCHEMA): one row per release range they fall in, not a row
    per cell (Spark then moves a few binary rows per task and range, never sums per cell)."""
    cells = np.flatnonzero(counts)
    ranges = cells // steps[table_id]
    cuts = np.flatnonzero(np.diff(ranges)) + 1  # cells ascend, so each range's cells are one run
    runs = np.split(np.arange(cells.size), cuts) if cells.size else []
    return pa.RecordBatch.from_pydict({
        "table_id": pa.array(np.full(len(runs), table_id, dtype=np.int32)),
        "range_id": pa.array(np.array([ranges[run[0]] for run in runs], dtype=np.int64)),
        "cells": pa.array([cells[run].astype(np.int64).tobytes() for run in runs], pa.binary()),
        "counts": pa.array([counts[cells[run]].astype(np.int64).tobytes() for run in runs], pa.binary()),
    })


def _bound_count_function(plan: Plan, unit: str | None, subkey: bytes, steps: list[int]):
    """Per partition of encoded records (`_by_unit`: all records of a unit together): bound contributions
    (bounding kernel) and measure every table (aggregation kernel); emit the nonzero entries as sparse partial
    counts, each with the release range it falls in."""
    columns = plan.encoded_columns()
    sizes = [plan.domains[c].size for c in columns]
    layouts = [t.layout for t in plan.tables]

    def bound_count(batches):
        encoded = _blob_records(batches, columns, unit)
        if encoded is None:
            return
        codes, rows, unit_values = encoded
        partial = bounded_counts(layouts, codes, rows, sizes, unit_values, plan.bounds.max_records_per_unit, subkey)
        for table_id, counts in enumerate(partial):
            yield _sparse_counts(table_id, counts, steps)

    return _worker_function("bound and count", bound_count)


def _bound_function(plan: Plan, unit: str | None, subkey: bytes):
    """Per partition of encoded records (`_by_unit`: all records of a unit together): bound contributions (the
    kernel `_bound_count_function` runs, on the same columns: the same records kept); emit the codes of the
    records kept, one int32 column per encoded column (`_kept_schema`). Private: they stay on the executors."""
    columns = plan.encoded_columns()
    sizes = [plan.domains[c].size for c in columns]

    def bound(batches):
        encoded = _blob_records(batches, columns, unit)
        if encoded is None:
            return
        codes, rows, unit_values = encoded
        kept, n_rows, _ = bounded_records(codes, rows, sizes, unit_values, plan.bounds.max_records_per_unit, subkey)
        for start in range(0, n_rows, ARROW_BATCH_ROWS):
            yield pa.RecordBatch.from_pydict({f"c{i}": pa.array(kept[c][start:start + ARROW_BATCH_ROWS].astype(np.int32))
                                              for i, c in enumerate(columns)})

    return _worker_function("bound", bound)


def _kept_schema(plan: Plan) -> str:
    """The Spark schema of kept records: one int column per encoded column, by position (c0, c1, ...)."""
    return ", ".join(f"c{i} int" for i in range(len(plan.encoded_columns())))


def _count_kept_function(plan: Plan, table_ids: list[int], steps: list[int]):
    """Per partition of kept records (`_bound_function`): the count tables `table_ids` measured over them, emitted
    as sparse partial counts with the release range each falls in (as `_bound_count_function` emits). Each
    table once, however often it is named (a table counted twice would be released with twice its sensitivity)."""
    columns = plan.encoded_columns()
    table_ids = sorted(set(table_ids))
    layouts = [plan.tables[i].layout for i in table_ids]

    def count(batches):
        totals = kept_counts(layouts, (({c: batch.column(i).to_numpy() for i, c in enumerate(columns)}, batch.num_rows)
                                       for batch in batches))
        for table_id, counts in zip(table_ids, totals):
            if counts.any():
                yield _sparse_counts(table_id, counts, steps)

    return _worker_function("count", count)


def _read_function(reader, tasks: list, schema: pa.Schema):
    """Per partition of task numbers: the records of those read tasks (`source.FileReader`), cast to `schema`
    (dictionary columns as their values, as Spark holds them)."""
    def read(batches):
        for batch in batches:
            for index in batch.column("task").to_pylist():
                for records in reader.batches(tasks[index]):
                    yield from pa.Table.from_batches([records]).cast(schema).to_batches()

    return _worker_function("read", read)


def _fails_first_attempt(stage: str = "noise") -> bool:
    """Test hook, read on the driver (executors do not see its environment): fail the first attempt of each
    task of `stage` ('noise' or 'groups')."""
    return os.environ.get(FAIL_FIRST_ATTEMPT_ENV) == stage


def _fail_if_first_attempt(what: str) -> None:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is not None and context.attemptNumber() == 0:
        raise RuntimeError(f"test hook: failing the first attempt of a {what} task")


def _noisy_values(releases, key: ReleaseKey, steps: list[int], batches: Iterator[pa.RecordBatch],
                  fail_first_attempt: bool) -> tuple[int, int, np.ndarray]:
    """(table id, first output, released values) of one (table, range) group of partial counts: every public
    cell of the range, empty ones included (a range's marker carries no count)."""
    if fail_first_attempt:
        _fail_if_first_attempt("noise")
    table_id, start, stop, measured = _range_counts(releases, steps, batches)
    release = releases[table_id]
    return table_id, release.output_start(start), release_range(key, release, start, stop, measured)


def _range_counts(releases, steps: list[int], batches: Iterator[pa.RecordBatch]) -> tuple[int, int, int, np.ndarray]:
    """(table id, start, stop, measured entries [start, stop)) of one (table, range) group of partial counts
    (COUNTS_SCHEMA: one row per task that counted records in the range, and the range's marker, which carries
    none), the tasks' counts added batch by batch as Spark hands them over (`dense_parts`): the task holds the range
    once, however many tasks counted in it."""
    first = next(batches)
    table_id = int(first.column("table_id")[0].as_py())
    start = int(first.column("range_id")[0].as_py()) * steps[table_id]
    stop = min(start + steps[table_id], releases[table_id].n_measured)
    return table_id, start, stop, dense_parts(start, stop, _row_parts(itertools.chain([first], batches)))


def _row_parts(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(cells, counts) of each partial-counts row (COUNTS_SCHEMA), read from its bytes without a copy."""
    for batch in batches:
        cells, counts = batch.column("cells"), batch.column("counts")
        for row in range(batch.num_rows):
            yield (np.frombuffer(cells[row].as_buffer(), dtype=np.int64),
                   np.frombuffer(counts[row].as_buffer(), dtype=np.int64))


def _noise_function(plan: Plan, key: ReleaseKey, steps: list[int]):
    """Released values per cell, for the driver (releases estimated globally)."""
    releases, fail_first_attempt = [t.release for t in plan.tables], _fails_first_attempt()

    def noise(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        table_id, first, values = _noisy_values(releases, key, steps, batches, fail_first_attempt)
        yield pa.RecordBatch.from_pydict({"table_id": pa.array(np.full(values.size, table_id, dtype=np.int32)),
                                          "cell": pa.array(np.arange(first, first + values.size, dtype=np.int64)),
                                          "noisy": pa.array(values)})

    return _worker_function("noise", noise)


def _score_function(plan: Plan, steps: list[int], estimates):
    """Per (candidate table, range) group of partial bounded counts: the range's part of the candidate's score
    (`transforms.mst.range_score`; every cell of the range, empty ones included). Only the integer leaves."""
    from dprelease.transforms.mst import range_score

    releases = [t.release for t in plan.tables]

    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        table_id, start, _, measured = _range_counts(releases, steps, batches)
        value = range_score(measured, start, estimates.value[table_id])
        yield pa.RecordBatch.from_pydict({"table_id": pa.array([table_id], pa.int32()),
                                          "score": pa.array([value], pa.int64())})

    return _worker_function("score", score)


def _noise_pieces_function(plan: Plan, key: ReleaseKey, steps: list[int], token: tuple, tree):
    """Released values as dataflow pieces routed to the post-processing stages (`pipelines.dataflow`);
    `tree`: a broadcast of the driver's tree of units."""
    from ..dataflow import flow_for, noise_piece, route_noise, to_batch

    releases, fail_first_attempt = [t.release for t in plan.tables], _fails_first_attempt()

    def noise(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        flow = flow_for(token, plan, tree.value)
        table_id, first, values = _noisy_values(releases, key, steps, batches, fail_first_attempt)
        yield to_batch(route_noise(flow, noise_piece(flow, table_id, first, values)))

    return _worker_function("noise", noise)


def _group_function(plan: Plan, token: tuple, tree):
    """One group of a post-processing or writing stage, in an executor."""
    from ..dataflow import flow_for, from_table, run_group, to_batch

    fail_first_attempt = _fails_first_attempt("groups")

    def run(group: pa.Table) -> pa.Table:
        pieces = from_table(group)
        out = run_group(flow_for(token, plan, tree.value), pieces[0].key, pieces)
        if fail_first_attempt:  # after this attempt's parts are written
            _fail_if_first_attempt("post-processing")
        return pa.Table.from_batches([to_batch(out)])

    return _worker_function("post-process", run)


def _range_steps(plan: Plan) -> list[int]:
    """Measured entries per noise range of every table (`dataflow.range_length`: whole units for a table of
    a tree of units): one rule for the counting and the noise stages, on every path."""
    from ..dataflow import Flow, range_length

    flow = Flow(plan, None, "")
    return [range_length(flow, i) for i in range(len(plan.tables))]


def _stage_output(frame):
    """A stage's output computed now, once, and kept on the executors' local disks (streamed there: a
    partition is never unrolled in the heap) under a fresh plan: later stages read it without recomputing it, and without carrying every earlier stage's
    plan (which grows with the stages and would fill the driver's heap). A lost executor fails the job
    (local checkpoints are not recomputed): nothing is published, and a re-run with the same key is free
    and gives the same bytes."""
    from pyspark import StorageLevel

    return frame.localCheckpoint(eager=True, storageLevel=StorageLevel.DISK_ONLY)


COUNTS_PER_PARTITION = 1_000_000
"""Counts per partition of the noise stage's input (each task sorts its partition by range)."""


def _shuffle_partitions(spark, groups: int) -> int:
    """Partitions of a shuffle with `groups` keys: a few per core, never more than the keys."""
    return max(1, min(groups, 4 * spark.sparkContext.defaultParallelism))


ARROW_SETTINGS = {"spark.sql.execution.arrow.pyspark.enabled": "true",
                  "spark.sql.execution.arrow.maxRecordsPerBatch": str(ARROW_BATCH_ROWS),
                  "spark.sql.execution.arrow.maxBytesPerBatch": str(BLOBS_BATCH_BYTES)}
"""Session settings the jobs need (runtime SQL settings: set on a caller's session for the job, then restored)."""


@contextlib.contextmanager
def _arrow_settings(spark):
    """ARROW_SETTINGS for one job; the session's own values are put back afterwards (unset where it had none)."""
    previous = {name: spark.conf.get(name, None) for name in ARROW_SETTINGS}
    for name, value in ARROW_SETTINGS.items():
        spark.conf.set(name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                spark.conf.unset(name)
            else:
                spark.conf.set(name, value)


def _group_column(heads: dict[int, int]):
    """`dataflow.group_key` as a column: a piece's key, under its run's first step when its step is fused."""
    from pyspark.sql import functions as F

    key = F.col("key")
    grouped = key
    for step, head in heads.items():
        grouped = F.when(F.shiftright(key, 40) == step, key + F.lit((head - step) << 40)).otherwise(grouped)
    return grouped


def _task_numbers(spark, count: int):
    """The read tasks' numbers 0 .. count-1 as a one-column frame ("task"), one number per partition, so every
    read task runs as its own Spark task. (A hash repartition of the numbers put both of a 10M-row input's two
    read tasks in one partition and left the other empty: one core read the whole input.)"""
    from pyspark.sql import functions as F

    return spark.range(0, count, 1, numPartitions=max(1, count)).select(F.col("id").cast("int").alias("task"))


def _stage_partitions(groups: int) -> int:
    """Partitions of a post-processing stage: one per group (a group is up to `--group-work` cells, so a
    task sorts and holds one group's rows, whatever the release's size)."""
    return max(1, min(groups, MAX_STAGE_PARTITIONS))


MAX_STAGE_PARTITIONS = 100_000


def _copy_job(context, copies):
    """`copies.collect()` on a thread of its own (pyspark's InheritableThread: its own connection to the JVM, in a
    job group of its own), the driver waiting on an event a signal interrupts: a SIGTERM raised in a py4j call
    waits for the call's answer, the whole job (a copy may wait 900 s on its store), and leaves the connection out
    of step. On failure or interruption the job is cancelled, or never submitted, and drained (`_drain`) for
    as long as the driver's own copies would be (`storage.objects.COPY_DRAIN_SECONDS`)."""
    import secrets

    from pyspark import InheritableThread

    from ..housekeeping import shielded
    from ..storage.objects import COPY_DRAIN_SECONDS

    group = f"dprelease-copy-{secrets.token_hex(8)}"
    outcome: dict = {}
    done, cancelled = threading.Event(), threading.Event()

    def collect() -> None:
        try:
            context.setJobGroup(group, "dprelease: copy staged parts into the release", interruptOnCancel=True)
            if not cancelled.is_set():
                outcome["digests"] = copies.collect()
        except BaseException as error:  # noqa: BLE001 - raised in the driver's thread
            outcome["error"] = error
        finally:
            done.set()

    try:
        InheritableThread(target=collect, name=group, daemon=True).start()
        while not done.wait(1.0):
            pass
        if "error" in outcome:
            raise outcome["error"]
        return outcome["digests"]
    except BaseException:
        cancelled.set()
        with shielded():  # a SIGTERM now waits for the drain (bounded): the main thread makes no py4j call
            _drain(context, group, done, time.monotonic() + COPY_DRAIN_SECONDS)
        raise


def _drain(context, group: str, done: threading.Event, deadline: float) -> None:
    """Until the deadline: the job group cancelled again and again until its collecting thread has ended (a job
    submitted after the first cancel is cancelled by a later one), then until no task of it runs. On a thread of
    its own: a signal in the main thread never lands inside one of these py4j calls (it would leave the
    connection out of step)."""
    from pyspark import InheritableThread

    def cancel_and_wait() -> None:
        with contextlib.suppress(Exception):
            while not done.is_set() and time.monotonic() < deadline:
                context.cancelJobGroup(group)
                done.wait(0.2)
            tracker = context.statusTracker()
            while time.monotonic() < deadline:
                stages = [s for job in tracker.getJobIdsForGroup(group)
                          if (info := tracker.getJobInfo(job)) is not None for s in info.stageIds]
                if not any((stage := tracker.getStageInfo(s)) is not None and stage.numActiveTasks
                           for s in stages):
                    return
                time.sleep(0.2)

    helper = InheritableThread(target=cancel_and_wait, name=f"{group}-drain", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()) + 1.0)


class SparkEngine(Engine):
    name = "spark"
    writes_parts = True

    def __init__(self, master: str | None = None, app_name: str = "dprelease", session=None):
        """`session`: a caller's SparkSession to run on (the Python API's); it is never stopped. Without one,
        the engine runs on the active session if there is one (never stopped either), else starts its own
        and stops it after each job."""
        _import_pyspark()  # a missing extra is a public spec error, before any key is drawn or budget reserved
        if session is not None and master:
            raise SpecError(f"--master = {shown(master)!r}: the release runs on the given Spark session; its master is "
                            "the session's")
        self.master = master
        self.app_name = app_name
        self.given_session = session
        self.started_session = None
        """The session this engine started (stopped by `close`), if any."""
        self._kept = None
        """(signature, DataFrame) of the bounded records a selection keeps on the executors for its later passes."""

    def session(self):
        if self.given_session is not None:
            return self.given_session
        if self.started_session is not None:
            return self.started_session
        SparkSession = _import_pyspark()
        active = SparkSession.getActiveSession()
        if active is not None:
            if self.master and active.sparkContext.master != self.master:
                raise SpecError(f"--master = {shown(self.master)!r}: this process already runs a Spark session on "
                                f"{active.sparkContext.master!r} (one per process); pass no master to run on it")
            return active
        builder = SparkSession.builder.appName(self.app_name)
        master = self.master or ("local[*]" if "PYSPARK_GATEWAY_PORT" not in os.environ else None)
        if master:  # under spark-submit, which sets the master, none is given
            builder = builder.master(master)
        if _quick_jit_master(master) and not _jvm_options_configured():
            builder = builder.config("spark.driver.defaultJavaOptions", LOCAL_JVM_OPTIONS)
        _end_launched_jvm_at_exit()
        self.started_session = builder.getOrCreate()
        return self.started_session

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
        """The input's records as a DataFrame, read by the executors through pyarrow (`source.FileReader`: local
        paths, or any store pyarrow's filesystems reach, with no Hadoop connector): one task per file or range
        of row groups, each parsing a private copy of the bytes the key is bound to."""
        from pyspark.sql.pandas.types import from_arrow_schema

        plain = _plain_schema(source.dataset.schema, source.columns) if source.format == "parquet" else \
            pa.schema([pa.field(c, pa.string()) for c in source.columns])
        tasks = source.read_tasks(spark.sparkContext.defaultParallelism)
        listed = _task_numbers(spark, len(tasks))
        return listed.mapInArrow(_read_function(source.reader(), tasks, plain),
                                 from_arrow_schema(plain)).select(*source.columns)

    def validate_input(self, plan: Plan, source: InputSource, runner):
        """The value-level expectations on a Spark DataFrame, columns in the form the encoder reads
        them (integers as doubles, null when not an integer; codes as text)."""
        from pyspark.sql import functions as F

        from dprelease.transforms.domains import IntegerDomain

        from ..validation import ValidationOutcome

        spark = self.session()
        try:
            with _arrow_settings(spark):
                frame = self._read(spark, source)
                for name in plan.used_columns():
                    if isinstance(plan.domains[name], IntegerDomain):
                        number = F.expr(f"try_cast(`{name}` as double)")
                        frame = frame.withColumn(name, F.when(number == F.floor(number), number))
                    else:
                        frame = frame.withColumn(name, F.col(name).cast("string"))
                outcome = ValidationOutcome(runner.expectations)
                outcome.add(runner.validate(frame, "value"))
        except Exception as error:  # the run's `close` stops a session the engine started
            raise DPReleaseError(f"input validation on Spark failed: {type(error).__name__}") from error
        return outcome

    def close(self) -> None:
        """Drop the kept bounded records (from the executors' disks) and stop a session this engine started."""
        self._drop_kept()
        self._stop_started(self.started_session)

    def _drop_kept(self) -> None:
        if self._kept is not None:
            try:
                self._kept[1].unpersist()
            except Exception:  # noqa: BLE001 - a stopped session holds nothing any more
                pass
            self._kept = None

    def _stop_started(self, spark) -> None:
        """Stop `spark` if this engine started it (a caller's or an already active session is never stopped)."""
        if spark is not None and spark is self.started_session:
            spark.stop()
            self.started_session = None

    def noisy_measurements(self, plan: Plan, source: InputSource, key: ReleaseKey,
                           progress: ProgressHook = no_progress) -> dict[str, np.ndarray]:
        with self._job() as spark:
            steps = _range_steps(plan)
            ranges = self._ranged_counts(spark, plan, source, key, steps)
            progress("read", 1, 1)
            noisy = ranges.applyInArrow(_noise_function(plan, key, steps), "table_id int, cell long, noisy long")
            result = noisy.toArrow()
            progress("noise", 1, 1)
        return self._assemble(plan, result)

    @contextlib.contextmanager
    def _job(self):
        """A Spark session for one job (one the engine starts lives until `close`: a selection's kept records
        stay on its executors between passes); any Spark error becomes a public-only message (Spark wraps
        executor errors, whose text could quote data)."""
        spark = self.session()
        try:
            with _arrow_settings(spark):
                yield spark
        except BaseException as error:  # a SIGTERM's Terminated and Ctrl-C too: stop the executors' tasks now
            with contextlib.suppress(Exception):  # no task of a failed run goes on writing after it
                spark.sparkContext.cancelAllJobs()
            if isinstance(error, DPReleaseError) or not isinstance(error, Exception):
                raise
            raise InputChanged.in_worker(error) or DPReleaseError(f"the Spark job failed: {type(error).__name__}") \
                from error

    scores_candidates = True

    def score_candidates(self, plan: Plan, counting: list, one_way: list, estimates, source: InputSource,
                         key: ReleaseKey, progress: ProgressHook = no_progress) -> dict[str, int]:
        """Two jobs over the records bounded as for `counting`: the 1-way tables released to the driver (the
        values the release publishes), then each candidate scored in executors, range by range, from the
        estimates the driver broadcasts, and the ranges' scores summed per table in the executors: the driver
        receives one integer per candidate (no true count, nor any part of a score, reaches it). The input is
        read, encoded and bounded once a run: the records kept are persisted on the executors' disks and every
        later pass over the same columns (a `select: aim` query's) counts from them, as the embedded engine's
        passes do (the same records: bounding is keyed by the key and the codes of every encoded column)."""
        from pyspark.sql import functions as F

        counting_plan = dataclasses.replace(plan, tables=tuple(counting))
        ids = {t.name: i for i, t in enumerate(counting)}
        one_way_ids = [ids[t.name] for t in one_way]
        # ranges never change the values (noise is per cell); the default length spares the tree of units
        steps = [t.release.range_length(NOISE_RANGE_CELLS) for t in counting]
        progress("select", 0, 2)
        with self._job() as spark:
            # the input read and bounded once for both jobs: the counts of the 1-way and candidate tables kept
            # on the executors' local disks (as every stage output is), not recomputed by the second job
            released_names = {t.name for t in plan.tables}
            candidates = [i for i, t in enumerate(counting) if t.name not in released_names]
            records = self._kept_records(spark, counting_plan, source, key)
            counts = _stage_output(records.mapInArrow(
                _count_kept_function(counting_plan, one_way_ids + candidates, steps), COUNTS_SCHEMA))
            released = (self._grouped_ranges(spark, counting_plan, source, counts, steps, one_way_ids)
                        .applyInArrow(_noise_function(counting_plan, key, steps), "table_id int, cell long, noisy long")
                        .toArrow())
            assembled = self._assemble(counting_plan, released, one_way_ids)
            progress("select", 1, 2)
            wanted = estimates({t.name: assembled[t.name] for t in one_way})
            candidate_ids = sorted(ids[name] for name in wanted)
            broadcast = spark.sparkContext.broadcast({ids[name]: value for name, value in wanted.items()})
            try:
                scored = (self._grouped_ranges(spark, counting_plan, source, counts, steps, candidate_ids)
                          .applyInArrow(_score_function(counting_plan, steps, broadcast), "table_id int, score long")
                          .groupBy("table_id").agg(F.sum("score").alias("score"), F.count("*").alias("ranges"))
                          .toArrow())
            finally:
                broadcast.destroy()
            progress("select", 2, 2)
        names = {i: name for name, i in ids.items()}
        found = {names[i]: values for i, values in zip(scored.column("table_id").to_pylist(),
                                                     zip(scored.column("score").to_pylist(),
                                                         scored.column("ranges").to_pylist()))}
        expected = {name: counting[ids[name]].release.range_count(steps[ids[name]]) for name in wanted}
        return checked_scores(found, expected, "the Spark selection job")

    def _kept_records(self, spark, plan: Plan, source: InputSource, key: ReleaseKey):
        """The codes of the records bounded over `plan`'s encoded columns, read and bounded on the first call of a
        run and persisted on the executors' local disks; later calls over the same columns reuse them."""
        from pyspark import StorageLevel

        signature = kept_records_signature(plan, source, key)
        if self._kept is not None and self._kept[0] == signature:
            return self._kept[1]
        self._drop_kept()
        records = self._by_unit(spark, plan, source, key).mapInArrow(
            _bound_function(plan, source.unit_column, key.derive("dprelease/bound")), _kept_schema(plan))
        records = records.persist(StorageLevel.DISK_ONLY)
        records.count()  # read, encode and bound now, once
        self._kept = (signature, records)
        return records

    def _ranged_counts(self, spark, plan: Plan, source: InputSource, key: ReleaseKey, steps: list[int]):
        """The input read, bounded and counted in executors, grouped by (table, noise range) with a marker
        row for every range of every table (so that ranges without records are released too)."""
        return self._grouped_ranges(spark, plan, source, self._cell_counts(spark, plan, source, key, steps), steps)

    def _cell_counts(self, spark, plan: Plan, source: InputSource, key: ReleaseKey, steps: list[int],
                     table_ids: list[int] | None = None):
        """Partial counts (COUNTS_SCHEMA) of every nonzero cell of the plan's tables (only `table_ids` when
        given), the input read, bounded over every table of the plan and counted in executors."""
        from pyspark.sql import functions as F

        partial = self._by_unit(spark, plan, source, key).mapInArrow(
            _bound_count_function(plan, source.unit_column, key.derive("dprelease/bound"), steps), COUNTS_SCHEMA)
        if table_ids is not None:
            partial = partial.where(F.col("table_id").isin(list(table_ids)))
        return partial

    def _by_unit(self, spark, plan: Plan, source: InputSource, key: ReleaseKey):
        """The input's records encoded for `plan` in the executors as they read them (`_encode_shard_function`), as
        (part, blob) rows shuffled by part: every record of a unit in one partition, moved as a few large Arrow
        blobs (not a row per record, nor its text values)."""

        tasks = source.read_tasks(spark.sparkContext.defaultParallelism)
        partitions = max(spark.sparkContext.defaultParallelism, -(-source.estimated_rows() // ROWS_PER_PARTITION))
        listed = _task_numbers(spark, len(tasks))
        blobs = listed.mapInArrow(_encode_shard_function(source.reader(), tasks, plan, source.unit_column,
                                                         shard_salt(key), partitions), "part int, blob binary")
        return blobs.repartition(partitions, "part")

    def _grouped_ranges(self, spark, plan: Plan, source: InputSource, counts, steps: list[int],
                        table_ids: list[int] | None = None):
        """`counts` (of `_cell_counts`) of `table_ids` (every table when None) with a marker row for every
        range of those tables, grouped by (table, noise range)."""
        from pyspark.sql import functions as F

        chosen = set(range(len(plan.tables)) if table_ids is None else table_ids)
        if table_ids is not None:
            counts = counts.where(F.col("table_id").isin(list(table_ids)))
        ranges = [(i, r, b"", b"") for i, t in enumerate(plan.tables) if i in chosen
                  for r in range(t.release.range_count(steps[i]))]
        markers = spark.createDataFrame(ranges, COUNTS_SCHEMA)
        records = source.estimated_rows() * len(plan.tables)  # at most one count per (row, table)
        partitions = max(_shuffle_partitions(spark, len(ranges)), -(-records // COUNTS_PER_PARTITION))
        return (counts.select("table_id", "range_id", "cells", "counts").unionByName(markers)
                .repartition(min(partitions, len(ranges)), "table_id", "range_id")
                .groupBy("table_id", "range_id"))

    def release_parts(self, plan: Plan, source: InputSource, key: ReleaseKey, staging: Path, staging_token: str,
                      layout, progress: ProgressHook = no_progress):
        """The whole release after the input, in executors: noise, then each post-processing stage (a
        shuffle by group key, a kernel per group: `pipelines.dataflow`), every table part written into
        `staging` (a directory the executors reach). The driver receives the file entries and variance
        summaries only. Only for releases whose count tables form a tree of units."""
        from pyspark.sql import functions as F

        from ..dataflow import (FILES, SPARK_SCHEMA, Flow, from_table, results, run_token, stage_groups, stage_order,
                                stage_sources)

        token = run_token(plan, layout, staging, staging_token)
        flow = Flow(plan, layout, str(staging))
        with self._job() as spark:
            tree = spark.sparkContext.broadcast(flow.tree)
            steps = _range_steps(plan)
            noise = _stage_output(self._ranged_counts(spark, plan, source, key, steps)
                                  .applyInArrow(_noise_pieces_function(plan, key, steps, token, tree), SPARK_SCHEMA))
            progress("noise", 1, 1)
            pools = [noise]
            stages = stage_order(flow)
            for done, (prefixes, sources) in enumerate(zip(stages, stage_sources(flow, stages))):
                inputs = None
                for source_index in sources:
                    chosen = pools[source_index].where(F.shiftright(F.col("key"), 40).isin(prefixes))
                    inputs = chosen if inputs is None else inputs.unionByName(chosen)
                grouped = inputs.withColumn("group", _group_column(flow.heads))
                pools.append(_stage_output(grouped.repartition(_stage_partitions(stage_groups(flow, prefixes)), "group")
                                           .groupBy("group").applyInArrow(_group_function(plan, token, tree), SPARK_SCHEMA)))
                progress("post-process", done + 1, len(stages))
            files = None
            for frame in pools[1:]:
                chosen = frame.where(F.col("kind") == FILES)
                files = chosen if files is None else files.unionByName(chosen)
            collected = from_table(files.toArrow()) if files is not None else []
        return results(collected)

    copies_parts = True

    def copy_parts(self, release_uri: str, release_path: str, parts) -> list[tuple[str, str]]:
        """The staged parts copied into the release and read back in executors (`storage.copy_checked`, one
        share of the parts per task, as many tasks as the session runs at once): the driver receives each copy's
        name and SHA-256, never its bytes. The job runs on a thread of its own (`_copy_job`), so a signal stops
        the driver's wait at once and cancels the job's tasks."""
        from ..storage import copy_checked

        parts = [tuple(part) for part in parts]
        if not parts:
            return []
        with self._job() as spark:
            context = spark.sparkContext
            shares = context.parallelize(parts, min(len(parts), max(1, context.defaultParallelism)))
            return _copy_job(context, shares.mapPartitions(
                lambda share: copy_checked(release_uri, release_path, list(share))))

    @staticmethod
    def _assemble(plan: Plan, result: pa.Table, table_ids: list[int] | None = None) -> dict[str, np.ndarray]:
        """The released vector of every table (of `table_ids` when given) from the rows the noise stage
        returned."""
        ids = result.column("table_id").to_numpy()
        cells = result.column("cell").to_numpy()
        values = result.column("noisy").to_numpy()
        out = {}
        for i, t in enumerate(plan.tables):
            if table_ids is not None and i not in table_ids:
                continue
            mine = ids == i
            vector = np.zeros(t.n_outputs, dtype=np.int64)
            vector[cells[mine]] = values[mine]
            if np.count_nonzero(mine) != t.n_outputs:
                raise DPReleaseError(f"table {t.name}: the Spark job returned {np.count_nonzero(mine)} of {t.n_outputs} values")
            out[t.name] = vector
        return out

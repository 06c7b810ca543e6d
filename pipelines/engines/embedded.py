"""The embedded engine: one machine, streaming batches, numpy kernels; the reference behaviour.

Memory stays flat as the input grows: encoded records (unit + small integer codes) are
hash-partitioned by unit into spill files when the input is large, and each partition is
bounded and aggregated on its own (a unit's records always meet in one partition). Such an input
is read, spilled, bounded and counted by worker processes (read tasks, then partitions).
Noise is drawn in worker processes over ranges of each table's cells.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from dprelease.transforms.aggregate import bounded_counts, kept_counts
from dprelease.transforms.bound import shard_pieces, shard_salt, unit_shards
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.encode import UNIT, ColumnEncoder, encoded_table
from dprelease.transforms.release_values import release_table
from dprelease.transforms.samplers import table_noise

from ..housekeeping import leftover_tag, shielded_temporary_directory
from ..plan import Plan
from ..source import FileReader, InputSource, ReadTask
from .base import Engine, ProgressHook, kept_records_signature, no_progress
from .workers import worker_pool


def spill_prefix(release_id: str) -> str:
    """Name prefix of a release's spill directories in TMPDIR: the owner's process token follows it."""
    return f"dprelease-spill-{release_id}@"


PARTITION_BYTES = 64 << 20
"""Encoded bytes (4 per column + 8 for the unit) per spill partition; bounds peak memory."""
READ_JOBS_PER_WORKER = 4
"""Read jobs per worker when workers read a spilling input (its read tasks in that many contiguous runs)."""
NOISE_RANGE_CELLS = 1 << 18


def private_ipc_file(path: Path, schema: pa.Schema) -> pa.ipc.RecordBatchFileWriter:
    """An Arrow IPC file writer on a new file created owner-only (0600) before anything is written to it."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return pa.ipc.new_file(str(path), schema)


class SpillPartitions:
    """Encoded records split into `count` partitions by a keyed hash of the unit (in memory if count == 1). Each
    writer (a read task) writes its own files, part-P-WRITER.arrow, so workers can spill into one directory at
    once; a partition is the union of every writer's file for it (`partition_files`)."""

    def __init__(self, count: int, directory: Path, salt: int, writer: int = 0):
        self.count = count
        self._salt = salt
        self._memory: list[pa.Table] = []
        self._directory = directory
        self._writer = writer
        self._writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}

    def add(self, table: pa.Table) -> None:
        if self.count == 1:
            self._memory.append(table)
            return
        for p, piece in shard_pieces(table, unit_shards(table.column(UNIT), self.count, self._salt), self.count):
            if p not in self._writers:
                self._writers[p] = private_ipc_file(self._directory / f"part-{p}-{self._writer:06d}.arrow",
                                                    table.schema)
            self._writers[p].write_table(piece)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()

    def tables(self):
        if self.count == 1:
            if self._memory:
                yield pa.concat_tables(self._memory)
            self._memory = []
            return
        self.close()
        for p in range(self.count):
            with partition_table(self._directory, p) as part:
                if part is not None:
                    yield part


def partition_files(directory: Path, partition: int) -> list[Path]:
    """The files of one spill partition, every writer's, in writer order."""
    return sorted(directory.glob(f"part-{partition}-*.arrow"))


@contextlib.contextmanager
def partition_table(directory: Path, partition: int):
    """One spill partition as a table (None when no writer wrote to it), mapped from its files while open."""
    files = partition_files(directory, partition)
    if not files:
        yield None
        return
    yield pa.concat_tables(_mapped_table(f) for f in files)


def _mapped_table(path: Path) -> pa.Table:
    """An Arrow IPC file's table, its buffers mapped from the file (the file itself closed: no descriptor is held
    per file, however many a partition has)."""
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


class _RecordSink:
    """The codes of bounded records, appended batch by batch to an Arrow IPC file created owner-only (0600)."""

    def __init__(self, path: Path):
        self.path, self._writer = path, None

    def __call__(self, codes: dict[str, np.ndarray], rows: int) -> None:
        if not rows:
            return
        table = pa.table({c: pa.array(values) for c, values in codes.items()})
        if self._writer is None:
            self._writer = private_ipc_file(self.path, table.schema)
        self._writer.write_table(table)

    def __enter__(self) -> "_RecordSink":
        return self

    def __exit__(self, *exc) -> None:
        if self._writer is not None:
            self._writer.close()


def _spill_read_tasks(reader: FileReader, tasks: list[ReadTask], encoders: dict[str, ColumnEncoder], unit: str,
                      partitions: int, salt: int, directory: str, writer: int) -> None:
    """A worker's part of reading: some read tasks' records encoded and spilled into the partitions by unit (one
    file per partition for the job, so the spill holds at most jobs x partitions files however many the input)."""
    spill = SpillPartitions(partitions, Path(directory), salt, writer)
    for task in tasks:
        for batch in reader.batches(task):
            spill.add(encoded_table(batch, encoders, unit))
    spill.close()


def _count_partitions(layouts: list, columns: list[str], sizes: list[int], k: int, subkey: bytes, directory: str,
                      partitions: list[int], keep: str | None) -> list[np.ndarray]:
    """A worker's part of counting: the bounded measurement vectors of whole spill partitions, summed (each holds
    all records of its units, so bounding a partition bounds its units). `keep`: a directory that also receives
    the codes of the records kept, one file per partition."""
    totals = [np.zeros(layout.n_measured, dtype=np.int64) for layout in layouts]
    for p in partitions:
        sink = _RecordSink(Path(keep) / f"bounded-{p:06d}.arrow") if keep else None
        with partition_table(Path(directory), p) as part, contextlib.ExitStack() as stack:
            if part is None:
                continue
            if sink is not None:
                stack.enter_context(sink)
            partial = bounded_counts(layouts, {c: part.column(c).to_numpy() for c in columns}, part.num_rows, sizes,
                                     part.column(UNIT), k, subkey, sink)
        for total, values in zip(totals, partial):
            total += values
    return totals


class EmbeddedEngine(Engine):
    name = "embedded"

    def __init__(self, workers: int | None = None):
        self.workers = workers or os.cpu_count() or 1
        self._spill: tempfile.TemporaryDirectory | None = None
        self._bounded: tuple | None = None  # (signature, path) of the selection's bounded records

    def true_counts(self, plan: Plan, source: InputSource, key: ReleaseKey, progress: ProgressHook,
                    keep: Path | None = None) -> dict[str, np.ndarray]:
        """Bounded measurement vectors of every table (`keep`, a private directory, also receives the codes of the
        records kept, in files bounded-*.arrow). Private: only `noisy_measurements` and the selection may see them.

        An input that spills (more than PARTITION_BYTES encoded) is read and counted by the workers: each reads
        its read tasks (row-group ranges) and spills their records into partitions by unit, then each bounds and
        counts whole partitions. A unit's records meet in one partition whatever the split, and counts add up
        exactly, so any number of workers gives the same vectors as one."""
        columns = plan.encoded_columns()
        encoders = {c: ColumnEncoder(plan.domains[c]) for c in columns}
        sizes = [plan.domains[c].size for c in columns]
        unit = source.unit_column
        row_bytes = 4 * len(columns) + 8
        partitions = max(1, -(-source.estimated_rows() * row_bytes // PARTITION_BYTES)) if unit else 1
        subkey = key.derive("dprelease/bound")
        # a 0700 directory, removed on every exit path (SIGTERM too, see run.py); a later run of the
        # release removes one left by SIGKILL (its name carries the owner's process token)
        with shielded_temporary_directory(f"{spill_prefix(plan.spec.release_id)}{leftover_tag()}") as spill_dir:
            if partitions > 1 and self.workers > 1 and source.workers_can_read:
                partitions = -(-partitions // self.workers) * self.workers  # every worker counts as many
                vectors = self._counts_in_workers(plan, source, key, subkey, encoders, sizes, partitions,
                                                  Path(spill_dir), progress, keep)
                return {t.name: v for t, v in zip(plan.tables, vectors)}
            counts = {t.name: np.zeros(t.layout.n_measured, dtype=np.int64) for t in plan.tables}
            spill = SpillPartitions(partitions, Path(spill_dir), shard_salt(key))
            files = source.files()
            with _RecordSink(keep / "bounded-0.arrow") if keep else contextlib.nullcontext() as sink:
                for done, path in enumerate(files):
                    for batch in source.batches(path):
                        table = encoded_table(batch, encoders, unit)
                        if unit:
                            spill.add(table)
                        else:
                            self._accumulate(plan, table, None, sizes, subkey, counts, sink)
                    progress("read", done + 1, len(files))
                for part in spill.tables():
                    self._accumulate(plan, part, part.column(UNIT), sizes, subkey, counts, sink)
                    del part
        return counts

    def _counts_in_workers(self, plan: Plan, source: InputSource, key: ReleaseKey, subkey: bytes, encoders: dict,
                           sizes: list[int], partitions: int, spill_dir: Path, progress: ProgressHook,
                           keep: Path | None) -> list[np.ndarray]:
        """`true_counts` of a spilling input in `self.workers` processes: reading (read tasks spilled by unit),
        then counting (partitions dealt round-robin), each phase finished before the next starts."""
        tasks = source.read_tasks(self.workers)
        jobs = min(len(tasks), READ_JOBS_PER_WORKER * self.workers)  # each job's writer spills into its own files
        reader, salt = source.reader(), shard_salt(key)
        with worker_pool(self.workers) as pool:
            reads = [pool.submit(_spill_read_tasks, reader, tasks[len(tasks) * j // jobs:len(tasks) * (j + 1) // jobs],
                                 encoders, source.unit_column, partitions, salt, str(spill_dir), j)
                     for j in range(jobs)]
            for done, read in enumerate(reads):
                read.result()
                progress("read", done + 1, jobs)
            layouts = [t.layout for t in plan.tables]
            counted = [pool.submit(_count_partitions, layouts, plan.encoded_columns(), sizes,
                                   plan.bounds.max_records_per_unit, subkey, str(spill_dir),
                                   list(range(w, partitions, self.workers)), str(keep) if keep else None)
                       for w in range(self.workers)]
            totals = [np.zeros(layout.n_measured, dtype=np.int64) for layout in layouts]
            for future in counted:
                for total, values in zip(totals, future.result()):
                    total += values
        return totals

    @staticmethod
    def _accumulate(plan: Plan, table: pa.Table, units, sizes: list[int], subkey: bytes,
                    counts: dict[str, np.ndarray], sink=None) -> None:
        # the codes dict is built inline so the kernel holds its only reference and can drop
        # the unbounded arrays once filtered (peak memory)
        partial = bounded_counts([t.layout for t in plan.tables],
                                 {c: table.column(c).to_numpy() for c in plan.encoded_columns()}, table.num_rows,
                                 sizes, units, plan.bounds.max_records_per_unit, subkey, sink)
        for t, values in zip(plan.tables, partial):
            counts[t.name] += values

    scores_candidates = True

    def score_candidates(self, plan: Plan, counting: list, one_way: list, estimates, source: InputSource,
                         key: ReleaseKey, progress: ProgressHook = no_progress) -> dict[str, int]:
        """The first call reads, encodes and bounds the input as `true_counts` does, and keeps the codes of the
        records kept in a private spill file (0600, in a 0700 directory removed by `close`); later calls of the run
        over the same columns (a `select: aim` query's passes) count their tables from it: the same records, since
        bounding is keyed by the key and the codes of every encoded column, which the passes share."""
        from dprelease.transforms.mst import scores_from_counts

        counting_plan = dataclasses.replace(plan, tables=tuple(counting))
        signature = kept_records_signature(counting_plan, source, key)
        if self._bounded is not None and self._bounded[0] == signature:
            released, wanted = {t.name for t in plan.tables}, {t.name for t in one_way}
            needed = [t for t in counting if t.name not in released or t.name in wanted]
            counts = self._counts_from(self._bounded[1], dataclasses.replace(plan, tables=tuple(needed)))
        else:
            self.close()
            self._spill = tempfile.TemporaryDirectory(prefix=f"{spill_prefix(plan.spec.release_id)}{leftover_tag()}")
            kept = Path(self._spill.name)
            counts = self.true_counts(counting_plan, source, key, progress, kept)
            self._bounded = (signature, kept)
        return scores_from_counts(key, counts, [t.release for t in one_way], estimates, NOISE_RANGE_CELLS)

    @staticmethod
    def _counts_from(kept: Path, plan: Plan) -> dict[str, np.ndarray]:
        """Count tables of `plan` over the bounded records kept by `true_counts` (no unit or measure statistics)."""
        def batches():
            for path in sorted(kept.glob("bounded-*.arrow")):
                with pa.memory_map(str(path)) as source:
                    reader = pa.ipc.open_file(source)
                    for i in range(reader.num_record_batches):
                        batch = reader.get_batch(i)
                        yield {c: batch.column(c).to_numpy() for c in plan.encoded_columns()}, batch.num_rows

        return dict(zip((t.name for t in plan.tables), kept_counts([t.layout for t in plan.tables], batches())))

    def close(self) -> None:
        """Remove the selection's spill of bounded records (if any)."""
        if self._spill is not None:
            self._spill.cleanup()
        self._spill = self._bounded = None

    def noise(self, plan: Plan, key: ReleaseKey, progress: ProgressHook) -> dict[str, np.ndarray]:
        """Noise of every cell of every additive table, in parallel over cell ranges (same values for any split)."""
        additive = [t for t in plan.measured() if not t.release.selects]
        jobs = [(t.name, t.event.mechanism, start, min(start + NOISE_RANGE_CELLS, t.n_cells))
                for t in additive for start in range(0, t.n_cells, NOISE_RANGE_CELLS)]
        noise = {t.name: np.zeros(t.n_cells, dtype=np.int64) for t in plan.tables if not t.release.selects}
        total_cells = sum(t.n_cells for t in additive)
        if self.workers <= 1 or total_cells < 50_000:
            for i, (name, mechanism, start, stop) in enumerate(jobs):
                noise[name][start:stop] = table_noise(key, name, mechanism, start, stop)
                progress("noise", i + 1, len(jobs))
            return noise
        with worker_pool(self.workers) as pool:
            futures = [pool.submit(table_noise, key, *job) for job in jobs]
            for i, ((name, _, start, stop), future) in enumerate(zip(jobs, futures)):
                noise[name][start:stop] = future.result()
                progress("noise", i + 1, len(jobs))
        return noise

    def noisy_measurements(self, plan: Plan, source: InputSource, key: ReleaseKey,
                           progress: ProgressHook = no_progress) -> dict[str, np.ndarray]:
        counts = self.true_counts(plan, source, key, progress)
        noise = self.noise(plan, key, progress)
        released = {name: counts[name] + noise[name] for name in noise}
        for t in plan.tables:
            if t.release.selects:  # quantiles: selections in C, fast enough in this process
                released[t.name] = release_table(key, t.release, counts[t.name], NOISE_RANGE_CELLS)
        return released

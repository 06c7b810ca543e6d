"""The embedded engine: one machine, streaming batches, numpy kernels; the reference behaviour.

Memory stays flat as the input grows: encoded records (unit + small integer codes) are
hash-partitioned by unit into spill files when the input is large, and each partition is
bounded and aggregated on its own (a unit's records always meet in one partition).
Noise is drawn in worker processes over ranges of each table's cells.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from dprelease.transforms.aggregate import bounded_counts
from dprelease.transforms.bound import shard_salt, unit_shards
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.encode import UNIT, ColumnEncoder, encoded_table
from dprelease.transforms.release_values import release_table
from dprelease.transforms.samplers import table_noise

from ..housekeeping import leftover_tag
from ..plan import Plan
from ..source import InputSource
from .base import Engine, ProgressHook, no_progress


def spill_prefix(release_id: str) -> str:
    """Name prefix of a release's spill directories in TMPDIR: the owner's process token follows it."""
    return f"dprelease-spill-{release_id}@"


PARTITION_BYTES = 64 << 20
"""Encoded bytes (4 per column + 8 for the unit) per spill partition; bounds peak memory."""
NOISE_RANGE_CELLS = 1 << 18


class SpillPartitions:
    """Encoded records split into `count` partitions by a hash of the unit (in memory if count == 1)."""

    def __init__(self, count: int, directory: Path, salt: int):
        self.count = count
        self._salt = salt
        self._memory: list[pa.Table] = []
        self._directory = directory
        self._writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}

    def add(self, table: pa.Table) -> None:
        if self.count == 1:
            self._memory.append(table)
            return
        part = unit_shards(table.column(UNIT), self.count, self._salt)
        for p in range(self.count):
            piece = table.filter(pa.array(part == p))
            if piece.num_rows:
                if p not in self._writers:
                    path = self._directory / f"part-{p}.arrow"
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # owner-only, then filled
                    self._writers[p] = pa.ipc.new_file(str(path), table.schema)
                self._writers[p].write_table(piece)

    def tables(self):
        if self.count == 1:
            if self._memory:
                yield pa.concat_tables(self._memory)
            self._memory = []
            return
        for writer in self._writers.values():
            writer.close()
        for p in sorted(self._writers):
            with pa.memory_map(str(self._directory / f"part-{p}.arrow")) as source:
                yield pa.ipc.open_file(source).read_all()


class EmbeddedEngine(Engine):
    name = "embedded"

    def __init__(self, workers: int | None = None):
        self.workers = workers or os.cpu_count() or 1

    def true_counts(self, plan: Plan, source: InputSource, key: ReleaseKey, progress: ProgressHook) -> dict[str, np.ndarray]:
        """Bounded measurement vectors of every table. Private: only `noisy_measurements` may see them."""
        columns = plan.encoded_columns()
        encoders = {c: ColumnEncoder(plan.domains[c]) for c in columns}
        sizes = [plan.domains[c].size for c in columns]
        counts = {t.name: np.zeros(t.layout.n_measured, dtype=np.int64) for t in plan.tables}
        unit = source.unit_column
        row_bytes = 4 * len(columns) + 8
        partitions = max(1, -(-source.estimated_rows() * row_bytes // PARTITION_BYTES)) if unit else 1
        subkey = key.derive("dprelease/bound")
        files = source.files()
        # a 0700 directory, removed on every exit path (SIGTERM too, see run.py); a later run of the
        # release removes one left by SIGKILL (its name carries the owner's process token)
        with tempfile.TemporaryDirectory(prefix=f"{spill_prefix(plan.spec.release_id)}{leftover_tag()}") as spill_dir:
            spill = SpillPartitions(partitions, Path(spill_dir), shard_salt(key))
            for done, path in enumerate(files):
                for batch in source.batches(path):
                    table = encoded_table(batch, encoders, unit)
                    if unit:
                        spill.add(table)
                    else:
                        self._accumulate(plan, table, None, sizes, subkey, counts)
                progress("read", done + 1, len(files))
            for part in spill.tables():
                self._accumulate(plan, part, part.column(UNIT), sizes, subkey, counts)
                del part
        return counts

    @staticmethod
    def _accumulate(plan: Plan, table: pa.Table, units, sizes: list[int], subkey: bytes,
                    counts: dict[str, np.ndarray]) -> None:
        # the codes dict is built inline so the kernel holds its only reference and can drop
        # the unbounded arrays once filtered (peak memory)
        partial = bounded_counts([t.layout for t in plan.tables],
                                 {c: table.column(c).to_numpy() for c in plan.encoded_columns()},
                                 sizes, units, plan.bounds.max_records_per_unit, subkey)
        for t, values in zip(plan.tables, partial):
            counts[t.name] += values

    scores_candidates = True

    def score_candidates(self, plan: Plan, counting: list, one_way: list, estimates, source: InputSource,
                         key: ReleaseKey, progress: ProgressHook = no_progress) -> dict[str, int]:
        from dprelease.transforms.mst import scores_from_counts

        counts = self.true_counts(dataclasses.replace(plan, tables=tuple(counting)), source, key, progress)
        return scores_from_counts(key, counts, [t.release for t in one_way], estimates, NOISE_RANGE_CELLS)

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
        with ProcessPoolExecutor(max_workers=self.workers) as pool:
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

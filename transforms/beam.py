"""Apache Beam PTransforms over column batches, built on the engine-neutral kernels.

Elements are pyarrow Tables (a Parquet row group or CSV block, or a part of one), never single
rows. The steps, composable in any Beam pipeline:

    ReadInputBatches(reader)              read tasks (files, row-group ranges) -> pa.Table batches, read
                                          through the input's verified reader
    EncodeRecords(domains, unit)          batches -> encoded tables: integer codes of the public
                                          domains (+ the unit), invalid values by declared policy
    BoundContributions(k, subkey, sizes)  encoded tables -> the same, at most k records per unit:
                                          shard by a keyed hash of the unit, bound each shard with the
                                          bounding kernel (a unit's records all meet in one shard)
    CountCells(layouts)                   bounded tables -> (table, (cells, counts)): a combine of
                                          sparse per-batch measurement vectors (counts, sums, unit
                                          counts, quantile buckets); combined=False: not summed (AddNoise
                                          and ScoreCandidates sum each range's parts where it is released)
    Histogram / Marginals / Hierarchy     CountCells for the tables of one query of a plan
    AddNoise(releases, key)               (table, counts) -> (table, start, released int64 vector) for
                                          every range of every table's public cell domain, empty
                                          tables and cells included; noise from the sampler kernel,
                                          quantiles from the selection kernel
    WriteNoisyRanges(directory)           one .npy file per range, through Beam's FileSystems
    ScoreCandidates(releases, estimates)  candidate tables' counts -> (table, (integer score, ranges)) of a
                                          `select: mst` query, range by range in the workers
    KeepRecords(directory, columns)       (shard, bounded table) -> one private Arrow file per shard, which
    ReadKeptRecords(paths)                later pipelines of a selection read instead of the input

Privacy: a cell's noise is a pure function of (key, table, cell), and the records kept for a unit
depend only on (key, unit, records), so any sharding, bundling, retry or runner gives the same
release as the embedded engine. The key is either given (the launcher's, `dprelease run --engine beam`:
it then travels inside the serialized DoFns of a pipeline built and run once for that run, so on remote
runners the staging location must be as private as the key, deploy/beam/README.md) or a PCollection
holding a key drawn when the pipeline runs (`key_argument`), which no pipeline graph ever contains.
"""
from __future__ import annotations

import io
import os
from typing import Any, Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa

from .aggregate import TableLayout
from .bound import (bound_contributions, dense_unit_ids, record_keys, shard_pieces, shard_salt, shuffled,
                    unit_shards, unshuffled)
from .csprng import ReleaseKey
from .encode import UNIT, ColumnEncoder, encoded_table
from .release_values import TableRelease, dense_parts, release_range
from .samplers import FAIL_FIRST_ATTEMPT_ENV
from .worker_errors import public_failures

NOISE_RANGE_CELLS = 1 << 18


class ReadInputBatches(beam.PTransform):
    """Read tasks -> pa.Table batches, read by `reader` (`dprelease.pipelines.source.FileReader`: Parquet or CSV,
    local or through pyarrow's filesystems, which each worker opens from the input's URI with credentials from
    its environment; once the key is bound, each file parsed from a private copy of the bytes it is bound to)."""

    def __init__(self, reader):
        super().__init__()
        self.reader = reader

    def expand(self, tasks):
        reader = self.reader

        def read(task) -> Iterable[pa.Table]:
            for batch in reader.batches(task):
                yield pa.Table.from_batches([batch])

        return tasks | "ReadFiles" >> beam.FlatMap(public_failures("read", read)).with_output_types(Any)


class EncodeRecords(beam.PTransform):
    """Batches -> encoded tables (small integer codes per column, the unit as `__unit__`); rows with an
    invalid value under policy `drop`, or with a null unit, are removed (never an error)."""

    def __init__(self, domains: dict, unit: str | None):
        super().__init__()
        self.encoders = {c: ColumnEncoder(d) for c, d in sorted(domains.items())}
        self.unit = unit

    @classmethod
    def from_plan(cls, plan) -> "EncodeRecords":
        return cls({c: plan.domains[c] for c in plan.encoded_columns()}, plan.spec.privacy_unit)

    def expand(self, batches):
        encoders, unit = self.encoders, self.unit
        encode = public_failures("encode", lambda batch: encoded_table(batch, encoders, unit))
        return (batches | "Encode" >> beam.Map(encode).with_output_types(Any)
                | "DropEmpty" >> beam.Filter(lambda table: table.num_rows > 0).with_output_types(Any))


def key_argument(key):
    """What a transform hands its callables for `key`: the key itself, or, when `key` is a PCollection holding one
    key (drawn when the pipeline runs: `dprelease.transforms.beam_release.PublishedTables`), that PCollection as
    a singleton side input, resolved in each worker at run time (never part of the pipeline graph)."""
    return beam.pvalue.AsSingleton(key) if isinstance(key, beam.pvalue.PCollection) else key


def _split_by_shard(table: pa.Table, shards: int, key: ReleaseKey) -> Iterable[tuple[int, bytes]]:
    """(shard, rows of that shard as a zstd-compressed Arrow IPC stream: `shuffled`), the shard a keyed hash of
    the unit (`unit_shards`, `shard_pieces`); the runner's shuffle moves a third of the bytes a pickled table
    takes."""
    if UNIT not in table.column_names:
        raise ValueError("BoundContributions: the encoded records carry no privacy unit (privacy_unit: null); "
                         "build it with unit=False, or with BoundContributions.from_plan")
    for s, piece in shard_pieces(table, unit_shards(table.column(UNIT), shards, shard_salt(key)), shards):
        yield s, shuffled(piece)


def _bound_shard(pieces: Iterable[bytes], columns: list[str], sizes: list[int], k: int,
                 key: ReleaseKey) -> pa.Table:
    """All records of a shard's units (its pieces from `_split_by_shard`), bounded to k per unit by the bounding
    kernel."""
    table = pa.concat_tables([unshuffled(piece) for piece in pieces]).combine_chunks()
    keys = record_keys([table.column(c).to_numpy() for c in columns], sizes, table.num_rows)
    keep = bound_contributions(table.column(UNIT), keys, k, key.derive("dprelease/bound"))
    return table.filter(pa.array(keep))


class BoundContributions(beam.PTransform):
    """Encoded tables -> encoded tables with at most k records per privacy unit.

    Shards by a keyed hash of the unit (GroupByKey), so every unit's records meet in one shard; the k
    kept records are chosen by the keyed PRF of the bounding kernel, independent of the sharding."""

    def __init__(self, k: int, key, sizes: dict[str, int], shards: int = 16, unit: bool = True):
        """`key`: the bound release key, or a PCollection holding it (`key_argument`). `unit=False` (a spec with
        `privacy_unit: null`): every record is its own unit, k must be 1, and the records pass unchanged (there
        is nothing to bound)."""
        super().__init__()
        if not unit and k != 1:
            raise ValueError(f"BoundContributions: k = {k} without a privacy unit; each record is its own unit, "
                             "so k must be 1")
        self.k, self.key, self.shards, self.unit = k, key, shards, unit
        self.columns = sorted(sizes)
        self.sizes = [sizes[c] for c in self.columns]

    @classmethod
    def from_plan(cls, plan, key, shards: int = 16) -> "BoundContributions":
        sizes = {c: plan.domains[c].size for c in plan.encoded_columns()}
        return cls(plan.bounds.max_records_per_unit, key, sizes, shards, unit=plan.spec.privacy_unit is not None)

    def expand(self, encoded):
        if not self.unit:
            return encoded
        return self.bounded_shards(encoded) | "Tables" >> beam.Values()

    def bounded_shards(self, encoded):
        """Encoded tables -> (shard, all bounded records of the shard's units): one element per shard holding
        records, the same records whatever the bundling or retries (`KeepRecords` names a file after it)."""
        shards, columns, sizes, k, key = self.shards, self.columns, self.sizes, self.k, key_argument(self.key)
        split = public_failures("shard", _split_by_shard)
        bound = public_failures("bound", lambda element, key: [(element[0], _bound_shard(element[1], columns, sizes,
                                                                                          k, key))])
        return (encoded
                | "ShardByUnit" >> beam.FlatMap(split, shards, key).with_output_types(tuple[int, Any])
                | "GroupShards" >> beam.GroupByKey()
                | "BoundShard" >> beam.FlatMap(bound, key).with_output_types(tuple[int, Any]))


KEPT_PATTERN = "kept-*.arrow"


def _write_kept(element, directory: str, columns: list[str]) -> Iterable[str]:
    """One named table of bounded records as `<directory>/kept-<name>.arrow` (an Arrow IPC file of the code
    columns, no unit), written under a temporary name and renamed: an attempt retried or run twice leaves one
    whole file per name (the same records), and a killed attempt's temporary file matches no reader's pattern."""
    import uuid

    from apache_beam.io.filesystems import FileSystems

    name, table = element
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, pa.schema([table.schema.field(c) for c in columns])) as writer:
        writer.write_table(table.select(columns))
    final = f"{directory}/kept-{name}.arrow"
    temporary = f"{directory}/.writing-{uuid.uuid4().hex}"
    with FileSystems.create(temporary) as handle:
        handle.write(sink.getvalue().to_pybytes())
    FileSystems.rename([temporary], [final])  # replaces a file an earlier attempt left
    yield final


class KeepRecords(beam.PTransform):
    """(name, encoded table) -> one Arrow IPC file per name under `directory` (any Beam filesystem: as private as
    the records it holds), the codes of `columns` only. Names must be a pure function of the records (a bounded
    shard's number, a read task's batch): then a retried attempt rewrites its own file and no record is kept
    twice. `ReadKeptRecords` reads them back."""

    def __init__(self, directory: str, columns: list[str]):
        super().__init__()
        self.directory, self.columns = directory.rstrip("/"), list(columns)

    def expand(self, named):
        write = public_failures("keep records", _write_kept)
        return named | "WriteKept" >> beam.FlatMap(write, self.directory, self.columns).with_output_types(str)


def _read_kept(path: str) -> Iterable[pa.Table]:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as handle:
        yield pa.ipc.open_file(pa.py_buffer(handle.read())).read_all()


class ReadKeptRecords(beam.PTransform):
    """pipeline -> the encoded tables `KeepRecords` wrote to the files `paths` (listed by the caller once the
    pipeline that wrote them succeeded), spread over the workers."""

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = list(paths)

    def expand(self, pipeline):
        read = public_failures("read kept records", _read_kept)
        return (pipeline | "KeptFiles" >> beam.Create(self.paths) | "Spread" >> beam.Reshuffle()
                | "ReadKept" >> beam.FlatMap(read).with_output_types(Any))


COMPACT_ENTRIES = 1 << 18
"""Entries a table's sparse-count accumulator gathers (and at least 4x its last sum's) before it sums them."""
COMPACT_PAIRS = 256
"""Pairs it gathers before it sums those since its last sum among themselves (many small parts)."""


def summed_counts(cells: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct cells, ascending; each one's counts summed): exact in int64, wrapping as numpy's sums do."""
    order = np.argsort(cells, kind="stable")
    cells, counts = np.asarray(cells, dtype=np.int64)[order], np.asarray(counts, dtype=np.int64)[order]
    if cells.size == 0:
        return cells, counts
    starts = np.flatnonzero(np.concatenate([[True], cells[1:] != cells[:-1]]))
    return cells[starts], np.add.reduceat(counts, starts)


class _SumSparseCounts(beam.CombineFn):
    """Sums (cells, counts) pairs of one table; the result is sparse and sorted by cell. The accumulator gathers
    pairs and sums them once they pass COMPACT_ENTRIES entries and four times the last sum's (and at the end):
    a sum per input made the work grow with inputs x table size."""

    def create_accumulator(self):
        return [[], 0, 0]  # pairs, their entries, the entries of the last sum

    @staticmethod
    def _compacted(accumulator):
        """Every pair summed into one (a lone pair too, unless its cells are distinct and ascending)."""
        pairs, _, _ = accumulator
        if len(pairs) > 1 or (pairs and np.any(np.diff(pairs[0][0]) <= 0)):
            pairs[:] = [summed_counts(np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs]))]
        entries = len(pairs[0][0]) if pairs else 0
        return [pairs, entries, entries]

    def add_input(self, accumulator, element):
        pairs, entries, last = accumulator
        if len(element[0]) == 0:  # a table with no record in a batch
            return accumulator
        pairs.append(element)
        entries += len(element[0])
        if entries > max(COMPACT_ENTRIES, 4 * last):
            return self._compacted([pairs, entries, last])
        if len(pairs) > COMPACT_PAIRS:  # many small parts: those since the last sum summed among themselves
            pending = pairs[1:] if last else pairs
            summed = summed_counts(np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending]))
            pairs[:] = (pairs[:1] if last else []) + [summed]
            entries = last + len(summed[0])
        return [pairs, entries, last]

    def compact(self, accumulator):
        """Summed before it crosses a shuffle (Beam compacts a lifted combine's accumulators)."""
        return self._compacted(accumulator)

    def merge_accumulators(self, accumulators):
        pairs = [pair for accumulator in accumulators for pair in accumulator[0]]
        return self._compacted([pairs, 0, 0])

    def extract_output(self, accumulator):
        pairs = self._compacted(accumulator)[0]
        return pairs[0] if pairs else (np.empty(0, np.int64), np.empty(0, np.int64))

    add_input = public_failures("sum counts", add_input)
    compact = public_failures("sum counts", compact)
    merge_accumulators = public_failures("sum counts", merge_accumulators)
    extract_output = public_failures("sum counts", extract_output)


class CountCells(beam.PTransform):
    """Bounded encoded tables -> (table name, (cells, counts)) for every table that has records:
    per batch, the aggregation kernel's measurement vector over the public domain (nonzero entries
    kept), combined across batches. AddNoise supplies the empty tables and cells. A bounded table holds
    every record of its units (one shard), so distinct units are counted exactly."""

    def __init__(self, layouts: list[TableLayout], combined: bool = True):
        """`combined=False`: each bounded table's (table, (cells, counts)) as it comes, not summed per table (for
        a step that sums them anyway, such as AddNoise's ranges: one shuffle fewer)."""
        super().__init__()
        self.layouts = list(layouts)
        self.combined = combined

    def expand(self, bounded):
        layouts = self.layouts

        def sparse_counts(table: pa.Table):
            codes = {c: table.column(c).to_numpy() for c in {c for layout in layouts for c in layout.inputs}}
            units = None
            if UNIT in table.column_names and any(layout.statistic == "units" for layout in layouts):
                units = dense_unit_ids(table.column(UNIT))
            for layout in layouts:
                counts = layout.measure_vector(codes, table.num_rows, units)
                cells = np.flatnonzero(counts)
                yield layout.name, (cells, counts[cells])

        counted = beam.FlatMap(public_failures("count", sparse_counts)).with_output_types(tuple[str, Any])
        counts = bounded | "SparseCounts" >> counted
        return counts | "SumCounts" >> beam.CombinePerKey(_SumSparseCounts()) if self.combined else counts


class _QueryCounts(CountCells):
    kind = ""

    def __init__(self, plan, query: str):
        tables = [t for t in plan.tables if t.query == query]
        if not tables or tables[0].kind != self.kind:
            raise ValueError(f"query {query!r}: not a {self.kind} query of this plan")
        super().__init__([t.layout for t in tables])


class Histogram(_QueryCounts):
    """CountCells for the table of a histogram query of a plan."""
    kind = "histogram"


class Marginals(_QueryCounts):
    """CountCells for every t-way marginal table of a marginals query of a plan."""
    kind = "marginals"


class Hierarchy(_QueryCounts):
    """CountCells for every level table of a hierarchy query of a plan."""
    kind = "hierarchy"


def _counted_parts(parts) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """A range's grouped (cells, counts) parts, without the public range marker (None) each range has."""
    return (part for part in parts if part is not None)


class _NoiseRange(beam.DoFn):
    """One range of one table: its measurements (zeros where no record fell) released by the table's
    mechanism (noise, or a quantile selection per cell and q)."""

    def __init__(self, releases: dict[str, TableRelease], steps: dict[str, int], fail_first_dir: str | None):
        self.releases, self.steps, self.fail_first_dir = releases, steps, fail_first_dir

    def start_bundle(self):
        self._ranges_seen: list[str] = []

    def process(self, element, key: ReleaseKey):
        (name, start), parts = element
        release = self.releases[name]
        stop = min(start + self.steps[name], release.n_measured)
        values = release_range(key, release, start, stop, dense_parts(start, stop, _counted_parts(parts)))
        self._ranges_seen.append(f"{name}-{start}")
        yield name, release.output_start(start), values

    process = public_failures("noise", process)

    def finish_bundle(self):
        """Test hook: a bundle holding a range not attempted before fails after all its noise was
        drawn and emitted; the runner must discard that output and retry the bundle."""
        if not self.fail_first_dir:
            return
        markers = [os.path.join(self.fail_first_dir, f"{seen}.attempted") for seen in self._ranges_seen]
        if not all(os.path.exists(marker) for marker in markers):
            for marker in markers:
                open(marker, "w").close()
            raise RuntimeError("test hook: failing the first attempt of a noise bundle")


class AddNoise(beam.PTransform):
    """(table, (cells, counts)) -> (table, output start, released values) for every range of every table.

    `releases`: name -> TableRelease (its measurement length and mechanism, None for an invariant). The
    ranges come from the public domain sizes, so every cell is released whether or not any record fell
    in it."""

    def __init__(self, releases: dict[str, TableRelease], key, range_cells: int = NOISE_RANGE_CELLS,
                 steps: dict[str, int] | None = None):
        """`key`: the bound release key, or a PCollection holding it (`key_argument`)."""
        super().__init__()
        self.releases, self.key, self.range_cells = dict(releases), key, range_cells
        self.steps = {name: (steps or {}).get(name) or release.range_length(range_cells)
                      for name, release in self.releases.items()}
        hook = os.environ.get(FAIL_FIRST_ATTEMPT_ENV, "")
        self.fail_first_dir = hook.removeprefix("noise:") if hook.startswith("noise:") else None

    @classmethod
    def from_plan(cls, plan, key, names: Iterable[str] | None = None,
                  range_cells: int = NOISE_RANGE_CELLS, steps: dict[str, int] | None = None) -> "AddNoise":
        """AddNoise for the plan's tables (or those in `names`), with their calibrated mechanisms; `steps`:
        measured entries per range by table, where not the default (ranges never change the noise)."""
        wanted = set(names) if names is not None else {t.name for t in plan.tables}
        return cls({t.name: t.release for t in plan.tables if t.name in wanted}, key, range_cells, steps)

    def expand(self, counts):
        return (counts | "Ranges" >> GroupRanges(self.releases, self.steps)
                | "Noise" >> beam.ParDo(_NoiseRange(self.releases, self.steps, self.fail_first_dir),
                                        key_argument(self.key)).with_output_types(Any))


class GroupRanges(beam.PTransform):
    """(table, (cells, counts)) -> ((table, start), parts) for every range of every table's measured entries,
    `steps[table]` entries a range: a range without records still comes (its parts hold only the public
    marker None), so a stage after it sees every cell of the public domain."""

    def __init__(self, releases: dict[str, TableRelease], steps: dict[str, int]):
        super().__init__()
        self.measured = {name: release.n_measured for name, release in releases.items()}
        self.steps = dict(steps)

    def expand(self, counts):
        steps = self.steps
        ranges = [((name, start), None) for name, n_measured in sorted(self.measured.items())
                  for start in range(0, n_measured, steps[name])]

        def split(element):
            name, (cells, values) = element
            cells, values = np.asarray(cells, dtype=np.int64), np.asarray(values)
            if np.any(cells[1:] < cells[:-1]):  # (CountCells' cells come ascending)
                order = np.argsort(cells, kind="stable")
                cells, values = cells[order], values[order]
            step = steps[name]
            first = cells // step
            starts = np.flatnonzero(np.diff(first, prepend=first[:1] - 1))  # each range's first cell (none: none)
            for begin, end in zip(starts, [*starts[1:], cells.size]):
                yield (name, int(first[begin]) * step), (cells[begin:end], values[begin:end])

        ranged = beam.FlatMap(public_failures("split ranges", split)).with_output_types(tuple[tuple[str, int], Any])
        return ((counts | "SplitRanges" >> ranged,
                 counts.pipeline | "PublicRanges" >> beam.Create(ranges))
                | "WithEveryRange" >> beam.Flatten()
                | "GroupRanges" >> beam.GroupByKey())


def _score_range(element, measured: dict[str, int], steps: dict[str, int], estimates: dict):
    """One range of one candidate table: its part of the candidate's selection score
    (`transforms.mst.range_score`; every cell of the range, empty ones included)."""
    from .mst import range_score

    (name, start), parts = element
    stop = min(start + steps[name], measured[name])
    yield name, (range_score(dense_parts(start, stop, _counted_parts(parts)), start, estimates[name]), 1)


def _sum_scores(values: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """(score, ranges) pairs summed: the candidate's score and how many ranges made it."""
    score = ranges = 0
    for part_score, part_ranges in values:
        score, ranges = score + part_score, ranges + part_ranges
    return score, ranges


class ScoreCandidates(beam.PTransform):
    """(candidate table, (cells, counts)) -> (table, (score, ranges)): each candidate of a `select: mst` query
    scored range by range in the workers against its independent estimate (`estimates[table]`: unit totals and
    the two attributes' shares, post-processing of released 1-way tables), the ranges' integer scores summed
    and counted (the driver checks the count: every range of the public domain scored once).
    Private: the scores feed the exponential mechanism only; no count leaves the worker that holds it."""

    def __init__(self, releases: dict[str, TableRelease], estimates: dict, range_cells: int = NOISE_RANGE_CELLS):
        super().__init__()
        self.releases, self.estimates = dict(releases), dict(estimates)
        self.steps = {name: release.range_length(range_cells) for name, release in self.releases.items()}

    def expected_ranges(self) -> dict[str, int]:
        """How many ranges each candidate's score must be made of (public: its domain and the range length)."""
        return {name: release.range_count(self.steps[name]) for name, release in self.releases.items()}

    def expand(self, counts):
        measured = {name: release.n_measured for name, release in self.releases.items()}
        return (counts | "Ranges" >> GroupRanges(self.releases, self.steps)
                | "ScoreRanges" >> beam.FlatMap(public_failures("score", _score_range), measured, self.steps,
                                                self.estimates)
                | "SumScores" >> beam.CombinePerKey(public_failures("sum scores", _sum_scores)))


def _read_key(path: str) -> ReleaseKey:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as handle:
        return ReleaseKey.from_hex(handle.read())


class KeyFromFile(beam.PTransform):
    """pipeline -> a PCollection of one key, read by a worker when the pipeline runs from a private file of this
    run (the launcher writes it, and removes it after the run): the graph holds the file's path, never the key
    (`key_argument` hands the PCollection to the bounding and noise steps as a singleton side input)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def expand(self, pipeline):
        read = beam.Map(public_failures("read the key", _read_key))
        return pipeline | "Where" >> beam.Create([self.path]) | "Read" >> read


class WriteNoisyRanges(beam.PTransform):
    """(table, start, values) -> one .npy file per range under `directory` (any Beam filesystem).
    A retried range rewrites the same bytes."""

    def __init__(self, directory: str, table_ids: dict[str, int]):
        super().__init__()
        self.directory, self.table_ids = directory.rstrip("/"), dict(table_ids)

    def expand(self, noisy):
        directory, table_ids = self.directory, self.table_ids

        def write(element):
            from apache_beam.io.filesystems import FileSystems

            name, start, values = element
            buffer = io.BytesIO()
            np.save(buffer, values, allow_pickle=False)
            path = f"{directory}/{table_ids[name]:05d}-{start:012d}.npy"
            with FileSystems.create(path) as handle:
                handle.write(buffer.getvalue())
            yield path

        return noisy | "WriteRanges" >> beam.FlatMap(public_failures("write", write)).with_output_types(str)

"""The release after the noise, as stages a distributed engine runs in its workers (Spark executors, Beam
workers): post-processing group by group and writing every part, so that nothing whose size grows with
the cells reaches the driver (it receives the file entries only).

Everything between stages is a *piece*: rows of one kind over a contiguous range of units of one level
(or of cells of one table), its arrays packed in one binary payload, with the key of the group that
consumes it. A stage is: split pieces at the consumer's group boundaries (`rekey`), group by key, run a
kernel on each group (`STAGES`). The kernels call the same per-unit kernels (`transforms.units`) with the
same groups (`transforms.units.groups`) as the embedded engine, and write parts with the same writer, so
every engine publishes the same bytes.

    noise pieces (per table range)
      leaves:  up(d)    per group of level d              -> up state of level d
      up(l):   per group of parents (levels l and l+1)    -> up state of level l           (l = d-1 .. 0)
      down(0): the root                                   -> down state of level 0, its parts written
      down(l): per group of level l (and its parents)     -> down state of level l, parts  (l = 1 .. d)
      cells:   per part of every other table              -> parts written (tables, measurements, means)
               per part of a debiased table               -> debiased/ parts written (randomized response)
Consecutive steps run in one group of one stage where no shuffle is needed between them (`fused_runs`): a
run of steps of one group each (the root's up and down steps, and the levels next to them while a level
fits one group), and the leaves' up step with the one above it (their groups are the same). Engines group
a stage by `group_key` (a step's key under its run's first step); the steps after the first hand their
pieces over in the worker, through the same wire format. The per-cell parts have no step before them and
run in the first stage. Fewer stages, the same groups and kernels: the same bytes.

The engine provides three operations: `rekey` (a flat map of Arrow batches), `group` (group by
`group_key` and apply a kernel to each group's rows) and `collect` (the small file entries).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dprelease.transforms.units.groups import transitions
from dprelease.transforms.units.kernels import DownState, UpState, down_group, root, up_group

from .debiased import debiased_frame, debiased_parts, debiased_tables
from .layout import MEASUREMENTS_DIR, TABLES_DIR, Layout, Part, mean_parts, table_parts
from .plan import Plan
from .manifest import VarianceSummary, plan_fingerprint
from .postprocessing import published_cells, unit_tree
from .release import check_staging, mean_column, part_writers, row_labels, table_values, write_part
from .storage import is_uri, open_remote_staging, put_part

SCHEMA = pa.schema([("key", pa.int64()), ("kind", pa.string()), ("level", pa.int32()), ("start", pa.int64()),
                    ("count", pa.int64()), ("payload", pa.binary())])
"""Every row between stages: the consuming group's key, what it holds, the level (or table index), its
first unit (or cell) and how many, and its arrays."""
SPARK_SCHEMA = "key long, kind string, level int, start long, count long, payload binary"

NOISE, UP, DOWN, FILES = "noise", "up", "down", "files"


# ---- payloads ---------------------------------------------------------------------------------------------------

def pack(arrays: dict[str, np.ndarray]) -> bytes:
    """Named arrays as bytes: a JSON header (names, dtypes, shapes) and the raw little-endian buffers."""
    header = json.dumps([[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]).encode()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return len(header).to_bytes(4, "little") + header + body


def unpack(data: bytes) -> dict[str, np.ndarray]:
    size = int.from_bytes(data[:4], "little")
    header = json.loads(data[4:4 + size])
    out, offset = {}, 4 + size
    for name, dtype, shape in header:
        count = math.prod(map(int, shape)) if shape else 1
        array = np.frombuffer(data, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)
        out[name] = array
        offset += count * np.dtype(dtype).itemsize
    return out


@dataclass(frozen=True)
class Piece:
    key: int
    kind: str
    level: int
    start: int
    count: int
    arrays: dict[str, np.ndarray]


MAX_PIECE_BYTES = 1 << 22
"""Largest payload of one row between stages (4 MiB): a larger piece travels as consecutive pieces of whole
units, which every kernel joins back (`_join`), so an engine never holds one huge row (Spark builds its
cached batches and Arrow rows in the JVM heap)."""


def bounded(piece: Piece, max_bytes: int | None = None) -> list[Piece]:
    """A piece as consecutive pieces of whole units (or cells) of at most `max_bytes` (default
    MAX_PIECE_BYTES) each, same key."""
    max_bytes = max_bytes or MAX_PIECE_BYTES
    per_row = sum(a.nbytes // max(len(a), 1) for a in piece.arrays.values() if a.ndim)
    if piece.kind == FILES or piece.count <= 1 or per_row * piece.count <= max_bytes:
        return [piece]
    rows = max(1, max_bytes // max(per_row, 1))
    return [Piece(piece.key, piece.kind, piece.level, piece.start + lo, min(rows, piece.count - lo),
                  _slice_arrays(piece.arrays, lo, min(lo + rows, piece.count)))
            for lo in range(0, piece.count, rows)]


def to_batch(pieces: list[Piece]) -> pa.RecordBatch:
    """Pieces as one Arrow batch of rows of at most MAX_PIECE_BYTES of payload each."""
    pieces = [part for piece in pieces for part in bounded(piece)]
    return pa.RecordBatch.from_arrays([
        pa.array([p.key for p in pieces], pa.int64()), pa.array([p.kind for p in pieces], pa.string()),
        pa.array([p.level for p in pieces], pa.int32()), pa.array([p.start for p in pieces], pa.int64()),
        pa.array([p.count for p in pieces], pa.int64()), pa.array([pack(p.arrays) for p in pieces], pa.binary())],
        schema=SCHEMA)


def from_table(table: pa.Table | pa.RecordBatch) -> list[Piece]:
    columns = [table.column(n).to_pylist() for n in ("key", "kind", "level", "start", "count", "payload")]
    return [Piece(k, kind, level, start, count, unpack(payload)) for k, kind, level, start, count, payload
            in zip(*columns)]


def _slice_arrays(arrays: dict[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
    return {name: (a[start:stop] if a.ndim else a) for name, a in arrays.items()}


def _join(pieces: list[Piece], kind: str, level: int) -> tuple[int, dict[str, np.ndarray]] | None:
    """The pieces of one kind and level, in order, as one range: (first unit, arrays)."""
    chosen = sorted((p for p in pieces if p.kind == kind and p.level == level), key=lambda p: p.start)
    if not chosen:
        return None
    names = chosen[0].arrays.keys()
    return chosen[0].start, {n: np.concatenate([p.arrays[n] for p in chosen]) for n in names}


# ---- the structure every worker derives from the plan ----------------------------------------------------------

class Flow:
    """What a worker knows: the plan, its tree, the groups of each level, the layout and where to write."""

    def __init__(self, plan: Plan, layout: Layout | None, staging: str, tree=None, staging_token: str | None = None):
        self.plan, self.layout = plan, layout or Layout()
        self.staging = staging if is_uri(staging) else Path(staging)
        """The run's staging directory (a path), or its staging prefix in the release's store (a URI)."""
        self.staging_token = staging_token
        self._staging_checked = False
        self._remote_staging = None
        self.tree = tree if tree is not None else unit_tree(plan)
        self.transitions = transitions(self.tree, self.layout.group_work) if self.tree else []
        self.table_index = {t.name: i for i, t in enumerate(plan.tables)}
        self.debiased = {self.table_index[d.table.name]: d for d in debiased_tables(plan)}
        self.debiased_parts = {i: debiased_parts(plan, d, self.layout) for i, d in self.debiased.items()}
        self.runs = fused_runs(self)
        """The tree's steps in order (prefixes), as the runs that share one group (`fused_runs`)."""
        self.heads = {prefix: run[0] for run in self.runs for prefix in run[1:]}
        """The first step of its run, for every step that is not first in its run."""
        self.fused = {run[0]: run for run in self.runs if len(run) > 1}
        """The runs of more than one step, by their first step."""

    # groups of each level, as boundaries over its units
    def child_bounds(self, level: int) -> np.ndarray:
        """The groups of level `level` as children (its own parts): unit boundaries."""
        if level == 0:
            return np.asarray([0, 1])
        return self.transitions[level - 1].child_start

    def parent_bounds(self, level: int) -> np.ndarray:
        """The groups of level `level` as parents of level + 1: unit boundaries."""
        return self.transitions[level].parent_start

    def tree_level(self, table: str) -> int | None:
        return self.tree.level_of(table).index if self.tree and table in self.tree.tables else None

    def write(self, part: Part, frame: pa.Table) -> list[dict]:
        """Write one part into the run's staging directory or prefix, once the worker has seen that it is the one
        the driver made for this run (`release.check_staging`, `storage.open_remote_staging`: otherwise nothing
        is written anywhere)."""
        if isinstance(self.staging, str):
            if self._remote_staging is None:
                self._remote_staging = open_remote_staging(self.staging, self.staging_token)
            return [put_part(self._remote_staging, name, write) for name, write in part_writers(part, frame)]
        if not self._staging_checked:
            check_staging(self.staging, self.staging_token)
            self._staging_checked = True
        return write_part(self.staging, part, frame)


def run_token(plan: Plan, layout: Layout, staging, staging_token: str) -> tuple:
    """What identifies a run's Flow in a worker: the plan fingerprint, the layout's sizes, the staging path (an
    absolute path, resolved on the driver) and its marker's token."""
    if not is_uri(str(staging)) and not Path(staging).is_absolute():
        raise ValueError(f"staging {staging}: a worker would resolve a relative path in its own directory")
    return plan_fingerprint(plan), layout.group_work, layout.part_rows, str(staging), staging_token


_FLOWS: dict[tuple, Flow] = {}


def flow_for(token: tuple, plan: Plan, tree) -> Flow:
    """The Flow of a run, built once per worker process (token: plan fingerprint, layout sizes, staging, its token).
    `tree` is the driver's: its operators (pseudo-inverses, gains) come out of LAPACK with bits that depend
    on the BLAS build and thread count, so workers never recompute them (every engine, one set of bits)."""
    if token not in _FLOWS:
        _FLOWS.clear()
        _FLOWS[token] = Flow(plan, Layout(token[1], token[2]), token[3], tree, token[4])
    return _FLOWS[token]


def flow_from(token: tuple, load_objects) -> Flow:
    """`flow_for` with the plan and the driver's tree pickled together (`load_objects()` gives the bytes: what a Beam
    pipeline ships once from its launcher), loaded only when this worker has not built the run's Flow yet."""
    if token not in _FLOWS:
        import pickle

        plan, tree = pickle.loads(load_objects())
        return flow_for(token, plan, tree)
    return _FLOWS[token]


def split(piece: Piece, bounds: np.ndarray, kind: str | None = None) -> list[Piece]:
    """A piece cut at group boundaries (unit indices), each part keyed by its group."""
    out = []
    stop = piece.start + piece.count
    first = int(np.searchsorted(bounds, piece.start, side="right")) - 1
    for group in range(first, bounds.size - 1):
        lo, hi = max(piece.start, int(bounds[group])), min(stop, int(bounds[group + 1]))
        if lo >= hi:
            break
        out.append(Piece(group, kind or piece.kind, piece.level, lo, hi - lo,
                         _slice_arrays(piece.arrays, lo - piece.start, hi - piece.start)))
    return out


# ---- noise pieces -> the stages' keys -----------------------------------------------------------------------------

def noise_piece(flow: Flow, table_index: int, start_cell: int, values: np.ndarray) -> Piece:
    """A range of one table's noisy values (cells [start_cell, ...)); for a tree table, whole units."""
    table = flow.plan.tables[table_index]
    level = flow.tree_level(table.name)
    if level is None:
        return Piece(0, NOISE, table_index, start_cell, values.size, {"values": values})
    per_unit = flow.tree.levels[level].table(table.name).size
    return Piece(0, NOISE, table_index, start_cell // per_unit, values.size // per_unit,
                 {"values": values.reshape(-1, per_unit)})


def route_noise(flow: Flow, piece: Piece) -> list[Piece]:
    """Where a noise piece goes: a tree table's units to the up step of its level (keyed by the groups of
    parents of the level below, or by its own groups at the leaves) and to the down step of its level; any
    other table's cells to the part it is written in."""
    table = flow.plan.tables[piece.level]
    level = flow.tree_level(table.name)
    routed = _debias_split(flow, piece)
    if level is None:
        routed += [_tagged(p, ("cells", piece.level)) for p in _cell_split(flow, table, piece)]
        for m, mean in enumerate(flow.plan.means):
            if table.name in (mean.sum_table, mean.count_table):
                bounds = np.asarray([p.start for p in mean_parts(flow.plan, mean, flow.layout)]
                                    + [table.n_cells])
                routed += [_tagged(p, ("means", m)) for p in split(piece, bounds)]
        return routed
    leaf = level == len(flow.tree.levels) - 1
    up_bounds = flow.child_bounds(level) if leaf else flow.parent_bounds(level)
    return routed + ([_tagged(p, ("up", level)) for p in split(piece, up_bounds)]
            + [_tagged(p, ("down", level)) for p in split(piece, flow.child_bounds(level))])


def _cell_split(flow: Flow, table, piece: Piece) -> list[Piece]:
    parts = table_parts(flow.plan, table, TABLES_DIR, flow.layout)
    quantum = max(1, len(table.quantiles))  # noisy values of a quantile table: a row per cell and q
    bounds = np.asarray([p.start for p in parts] + [parts[-1].stop]) // quantum * quantum
    return split(piece, bounds)


def _debias_split(flow: Flow, piece: Piece) -> list[Piece]:
    """A noise piece of a table with randomized axes, as cells, cut at its debiased parts (whole blocks)."""
    debiased = flow.debiased.get(piece.level)
    if debiased is None:
        return []
    values = piece.arrays["values"]
    per_row = values.size // max(piece.count, 1)
    cells = Piece(piece.key, piece.kind, piece.level, piece.start * per_row, values.size, {"values": values.ravel()})
    parts = flow.debiased_parts[piece.level]
    bounds = np.asarray([p.start for p in parts] + [parts[-1].stop])
    return [_tagged(p, ("debias", piece.level)) for p in split(cells, bounds)]


def _tagged(piece: Piece, stage: tuple[str, int]) -> Piece:
    """The piece under the key of its stage: (stage name, level or table) and group, flattened to one int."""
    return Piece(stage_key(stage, piece.key), piece.kind, piece.level, piece.start, piece.count, piece.arrays)


STAGE_CODES = {"up": 1, "down": 2, "cells": 3, "means": 4, "debias": 5}


def stage_key(stage: tuple[str, int], group: int) -> int:
    """One int64 per (stage, level or table, group): what engines group by."""
    name, level = stage
    return (STAGE_CODES[name] << 56) | (level << 40) | group


def key_group(key: int) -> int:
    return key & ((1 << 40) - 1)


# ---- kernels ---------------------------------------------------------------------------------------------------------

def _noisy_block(flow: Flow, level: int, pieces: list[Piece], start: int, count: int) -> np.ndarray:
    """Units [start, start + count) of a level as blocks (units x block cells) from their tables' pieces."""
    tree_level = flow.tree.levels[level]
    block = np.zeros((count, tree_level.size))
    for b in tree_level.tables:
        joined = _join(pieces, NOISE, flow.table_index[b.table.name])
        if joined is not None:
            first, arrays = joined
            block[first - start:first - start + arrays["values"].shape[0], b.offset:b.offset + b.size] = arrays["values"]
    return block


def up_kernel(flow: Flow, level: int, group: int, pieces: list[Piece]) -> list[Piece]:
    """The up step of a group: level `level`'s units of the group (as parents of level + 1, or the leaves'
    own groups), their noisy blocks and their children's up state; out: their up state, keyed for the
    up step above and the down step of their level."""
    tree = flow.tree
    leaf = level == len(tree.levels) - 1
    bounds = flow.child_bounds(level) if leaf else flow.parent_bounds(level)
    start, stop = int(bounds[group]), int(bounds[group + 1])
    noisy = _noisy_block(flow, level, pieces, start, stop - start)
    children = child_parent = None
    if not leaf:
        joined = _join(pieces, UP, level + 1)
        first, arrays = joined
        children = UpState(arrays["block"], arrays["own_total"], arrays["subtree"], arrays["subtree_var"])
        child_parent = tree.levels[level + 1].parent[first:first + arrays["block"].shape[0]] - start
    state = up_group(tree.levels[level], noisy, children, child_parent)
    piece = Piece(0, UP, level, start, stop - start, {"block": state.block, "own_total": state.own_total,
                                                      "subtree": state.subtree, "subtree_var": state.subtree_var})
    out = []
    if level > 0:
        out += [_tagged(p, ("up", level - 1)) for p in split(piece, flow.child_bounds(level))]
    out += [_tagged(p, ("down", level)) for p in split(piece, flow.child_bounds(level))]
    return out


def down_kernel(flow: Flow, level: int, group: int, pieces: list[Piece]) -> list[Piece]:
    """The down step of a group of level `level` (the root when 0): final totals, integers, and every part of
    the level's tables written (published and measurements); out: the level's down state keyed for the
    next level's groups of parents, and the written files' entries."""
    tree = flow.tree
    bounds = flow.child_bounds(level)
    start, stop = int(bounds[group]), int(bounds[group + 1])
    noisy = _noisy_block(flow, level, pieces, start, stop - start)
    first, arrays = _join(pieces, UP, level)
    state = UpState(arrays["block"], arrays["own_total"], arrays["subtree"], arrays["subtree_var"])
    if level == 0:
        down, output = root(tree, state, noisy)
    else:
        parent_first, parent = _join(pieces, DOWN, level - 1)
        parents = DownState(parent["final"], parent["final_var"],
                            {k.removeprefix("int:"): v for k, v in parent.items() if k.startswith("int:")})
        child_parent = tree.levels[level].parent[start:stop] - parent_first
        down, output = down_group(tree, tree.levels[level], parents, state, noisy, child_parent)
    entries = _write_level(flow, level, start, stop, noisy, output)
    summaries = {name: _summary_record(VarianceSummary.of(values.ravel(), [(0, values.size)]))
                 for name, values in output.variances.items()}
    out = [_files_piece(level, group, entries, summaries)]
    if level + 1 < len(tree.levels):
        piece = Piece(0, DOWN, level, start, stop - start,
                      {"final": down.final, "final_var": down.final_var,
                       **{f"int:{k}": v for k, v in down.integers.items()}})
        out += [_tagged(p, ("down", level + 1)) for p in split(piece, flow.parent_bounds(level))]
    return out


def _write_level(flow: Flow, level: int, start: int, stop: int, noisy: np.ndarray, output) -> list[dict]:
    """Write the parts of a level's tables that hold units [start, stop) (one part each, by the layout)."""
    entries = []
    tree_level = flow.tree.levels[level]
    for b in tree_level.tables:
        table = flow.plan.table(b.table.name)
        rows = (start * b.size, stop * b.size)
        for folder, values, name, variance in (
                (TABLES_DIR, output.published[table.name], table.value_name, output.variances[table.name]),
                (MEASUREMENTS_DIR, noisy[:, b.offset:b.offset + b.size], f"noisy_{table.value_name}", None)):
            part = next(p for p in table_parts(flow.plan, table, folder, flow.layout) if p.start == rows[0])
            columns = table_values(table, np.asarray(values).ravel().astype(np.int64), name,
                                   None if variance is None else np.asarray(variance).ravel())
            entries += flow.write(part, pa.table({**row_labels(flow.plan, table.dims, table.quantiles,
                                                                               part.start, part.stop), **columns}))
    return entries


def cells_kernel(flow: Flow, table_index: int, group: int, pieces: list[Piece]) -> list[Piece]:
    """A part of a table outside the tree: its noisy values in, its published and measurement parts
    written (post-processing cell by cell)."""
    table = flow.plan.tables[table_index]
    _, arrays = _join(pieces, NOISE, table_index)
    values = arrays["values"].astype(np.int64)
    published = published_cells(table, values)
    entries = []
    for folder, data, name in ((TABLES_DIR, published, table.value_name),
                               (MEASUREMENTS_DIR, values, f"noisy_{table.value_name}")):
        part = table_parts(flow.plan, table, folder, flow.layout)[group]
        entries += flow.write(part, pa.table({**row_labels(flow.plan, table.dims, table.quantiles,
                                                                           part.start, part.stop),
                                                            **table_values(table, data, name)}))
    return [_files_piece(table_index, group, entries)]


def means_kernel(flow: Flow, mean_index: int, group: int, pieces: list[Piece]) -> list[Piece]:
    """A part of a mean table from the same cells of its noisy sum and count tables."""
    mean = flow.plan.means[mean_index]
    noisy = {}
    for name in (mean.sum_table, mean.count_table):
        _, arrays = _join(pieces, NOISE, flow.table_index[name])
        noisy[name] = arrays["values"]
    part = mean_parts(flow.plan, mean, flow.layout)[group]
    dims = flow.plan.table(mean.sum_table).dims
    entries = flow.write(part, pa.table({**row_labels(flow.plan, dims, (), part.start, part.stop),
                                                       **mean_column(mean, noisy)}))
    return [_files_piece(mean_index, group, entries)]


def debias_kernel(flow: Flow, table_index: int, group: int, pieces: list[Piece]) -> list[Piece]:
    """A part of debiased/<table> from the same cells of the table's noisy values."""
    debiased = flow.debiased[table_index]
    _, arrays = _join(pieces, NOISE, table_index)
    part = flow.debiased_parts[table_index][group]
    entries = flow.write(part, debiased_frame(flow.plan, debiased, part, arrays["values"]))
    return [_files_piece(table_index, group, entries)]


def run_group(flow: Flow, key: int, pieces: list[Piece]) -> list[Piece]:
    """A group of a stage (`key`: any of its pieces' keys): its run of steps when the key's step is fused with
    others (`fused_runs`), else its step's kernel."""
    run = flow.fused.get(stage_of(group_key(flow.heads, key)))
    if run is None:
        return _run_step(flow, key, pieces)
    return _run_fused(flow, run, pieces)


def _run_step(flow: Flow, key: int, pieces: list[Piece]) -> list[Piece]:
    """Dispatch a group's pieces to its step's kernel."""
    code, level, group = key >> 56, (key >> 40) & 0xFFFF, key_group(key)
    stage = {v: k for k, v in STAGE_CODES.items()}[code]
    kernel = {"up": up_kernel, "down": down_kernel, "cells": cells_kernel, "means": means_kernel,
              "debias": debias_kernel}[stage]
    return kernel(flow, level, group, pieces)


def _run_fused(flow: Flow, run: tuple[int, ...], pieces: list[Piece]) -> list[Piece]:
    """The steps of a run in one group, in order: each step's groups (one, or the same group number) get the
    pieces keyed for them, from the stage's input and from the steps before, which hand them over through the
    wire format (`to_batch`, `from_table`), as a shuffle would. Out: what leaves the run (pieces for later
    stages, file entries)."""
    pool, out = list(pieces), []
    for i, prefix in enumerate(run):
        made = _run_groups(_by_key(pool, {prefix}, lambda key: key), _run_step, flow)
        pool = [piece for piece in pool if stage_of(piece.key) != prefix]
        later = set(run[i + 1:])
        inside = [p for p in made if p.kind != FILES and stage_of(p.key) in later]
        out += [p for p in made if p.kind == FILES or stage_of(p.key) not in later]
        pool += inside
    return out


def _summary_record(summary: VarianceSummary) -> list:
    return [summary.minimum, summary.maximum, list(summary.sums), summary.count]


def _files_piece(level: int, group: int, entries: list[dict], summaries: dict | None = None) -> Piece:
    """What a group reports to the driver: its written files' entries and (tree levels) each table's
    variance summary over its part. Small: a few hundred bytes per part."""
    document = json.dumps({"entries": entries, "summaries": summaries or {}, "group": group}).encode()
    return Piece(0, FILES, level, group, len(entries), {"files": np.frombuffer(document, dtype=np.uint8)})


def results(pieces: list[Piece]) -> tuple[list[dict], dict[str, VarianceSummary]]:
    """(every file entry, every tree table's variance summary, merged over its parts in order)."""
    entries, parts = [], {}
    for piece in pieces:
        if piece.kind != FILES:
            continue
        document = json.loads(bytes(piece.arrays["files"]))
        entries += document["entries"]
        for name, (low, high, sums, count) in document["summaries"].items():
            parts.setdefault(name, []).append((document["group"], VarianceSummary(low, high, tuple(sums), count)))
    summaries = {name: VarianceSummary.merged([s for _, s in sorted(found)]) for name, found in parts.items()}
    return entries, summaries


# ---- the order of stages, and a reference runner -----------------------------------------------------------------

NOISE_TARGET = 1 << 18


def range_length(flow: Flow, table_index: int) -> int:
    """Measured entries per noise range of a table: whole units for a tree table (so a range is a range of
    units), else the table's own ranges (whole cells of a quantile table). Noise does not depend on it."""
    table = flow.plan.tables[table_index]
    level = flow.tree_level(table.name)
    if level is None:
        return table.release.range_length(NOISE_TARGET)
    per_unit = flow.tree.levels[level].table(table.name).size
    return per_unit * max(1, NOISE_TARGET // per_unit)


def tree_steps(flow: Flow) -> list[int]:
    """The tree's steps in order, as (code << 16 | level) prefixes: the up steps leaves first, then the down steps
    root first."""
    if flow.tree is None:
        return []
    depth = len(flow.tree.levels)
    return ([STAGE_CODES["up"] << 16 | level for level in reversed(range(depth))]
            + [STAGE_CODES["down"] << 16 | level for level in range(depth)])


def fused_runs(flow: Flow) -> list[tuple[int, ...]]:
    """The tree's steps as runs that one group can do in order, without a shuffle between them: a step joins the
    run before it when every step of the run and it has one group (each step's group then reads only the run's
    group), or when it is the up step above the leaves' (the leaves' groups are its groups of parents, group for
    group). A public function of the tree and the layout."""
    runs: list[list[int]] = []
    steps = tree_steps(flow)
    for step in steps:
        if runs and _joins(flow, runs[-1], step, steps):
            runs[-1].append(step)
        else:
            runs.append([step])
    return [tuple(run) for run in runs]


def _joins(flow: Flow, run: list[int], step: int, steps: list[int]) -> bool:
    if all(_step_groups(flow, p) == 1 for p in (*run, step)):
        return True
    leaves_up, above = steps[0], steps[1]
    return run == [leaves_up] and step == above and above >> 16 == STAGE_CODES["up"]


def group_key(heads: dict[int, int], key: int) -> int:
    """What an engine groups a piece by: its key, under its run's first step when its step is fused into a run
    (`heads`: `Flow.heads`; the run's groups are numbered as each of its steps' groups)."""
    head = heads.get(stage_of(key))
    return key if head is None else (head << 40) | key_group(key)


def stage_order(flow: Flow) -> list[list[int]]:
    """The stages in order, each as the (code << 16 | level) prefixes of the keys it groups: the runs of the
    tree's steps (`fused_runs`), every per-cell part (tables and means) in the first stage (none reads
    another stage's output)."""
    stages = [list(run) for run in flow.runs]
    cells = [STAGE_CODES["cells"] << 16 | i for i, t in enumerate(flow.plan.tables) if flow.tree_level(t.name) is None]
    cells += [STAGE_CODES["means"] << 16 | m for m in range(len(flow.plan.means))]
    cells += [STAGE_CODES["debias"] << 16 | i for i in sorted(flow.debiased)]
    if cells and stages:
        stages[0] += cells
    elif cells:
        stages.append(cells)
    return stages


def stage_of(key: int) -> int:
    return key >> 40


def _emits(flow: Flow, prefix: int) -> set[int]:
    """The stage prefixes a stage's groups send pieces to (besides the driver's file entries)."""
    code, level = prefix >> 16, prefix & 0xFFFF
    up, down = STAGE_CODES["up"], STAGE_CODES["down"]
    if code == up:
        return {down << 16 | level} | ({up << 16 | (level - 1)} if level else set())
    if code == down and level + 1 < len(flow.tree.levels):
        return {down << 16 | (level + 1)}
    return set()


def stage_sources(flow: Flow, stages: list[list[int]]) -> list[list[int]]:
    """Per stage, the pools it reads: 0 the routed noise pieces, i + 1 the output of stage i (an engine
    filters only these, not every earlier output)."""
    sources = []
    for i, prefixes in enumerate(stages):
        wanted = set(prefixes)
        sources.append([0] + [j + 1 for j in range(i) if any(_emits(flow, p) & wanted for p in stages[j])])
    return sources


def stage_groups(flow: Flow, prefixes: list[int]) -> int:
    """How many groups a stage has (engines size its shuffle by it): a run's are its first step's."""
    return sum(_step_groups(flow, prefix) for prefix in prefixes if prefix not in flow.heads)


def _step_groups(flow: Flow, prefix: int) -> int:
    """How many groups one step has."""
    code, level = prefix >> 16, prefix & 0xFFFF
    if code == STAGE_CODES["up"]:
        leaf = level == len(flow.tree.levels) - 1
        return (flow.child_bounds(level) if leaf else flow.parent_bounds(level)).size - 1
    if code == STAGE_CODES["down"]:
        return flow.child_bounds(level).size - 1
    if code == STAGE_CODES["cells"]:
        return len(table_parts(flow.plan, flow.plan.tables[level], TABLES_DIR, flow.layout))
    if code == STAGE_CODES["means"]:
        return len(mean_parts(flow.plan, flow.plan.means[level], flow.layout))
    return len(flow.debiased_parts[level])


def run_local(flow: Flow, noise_pieces: list[Piece]) -> tuple[list[dict], dict[str, VarianceSummary]]:
    """The stages in this process, groups in key order: the reference the distributed engines match. Every
    stage's output goes through the wire format the engines use (`to_batch`, `from_table`)."""
    stages = stage_order(flow)
    pools = [from_table(to_batch([p for piece in noise_pieces for p in route_noise(flow, piece)]))]
    for prefixes, sources in zip(stages, stage_sources(flow, stages)):
        wanted = (p for source in sources for p in pools[source])
        pools.append(_run_groups(_by_key(wanted, set(prefixes), lambda key: group_key(flow.heads, key)), run_group, flow))
    return results([p for pool in pools[1:] for p in pool])


def _by_key(pieces, prefixes: set[int], key_of) -> dict[int, list[Piece]]:
    """The pieces of the steps `prefixes`, grouped by `key_of(piece.key)`, in their order."""
    groups: dict[int, list[Piece]] = {}
    for piece in pieces:
        if stage_of(piece.key) in prefixes:
            groups.setdefault(key_of(piece.key), []).append(piece)
    return groups


def _run_groups(groups: dict[int, list[Piece]], kernel, flow: Flow) -> list[Piece]:
    """Every group through `kernel`, in key order, its output through the wire format (`to_batch`, `from_table`),
    as a shuffle would hand it over."""
    return from_table(to_batch([out for key in sorted(groups) for out in kernel(flow, key, groups[key])]))

"""The tree of geographic units a release's count tables form, and each level's block operators.

Public: built from the plan alone (tables, domains, variances), identically on every engine and worker.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from ..aggregate import unravel_cells
from ..domains import NATION, Dimension, GeographyDomain
from ..estimation import CountTable, constraint_matrix

MAX_BLOCK_CELLS = 8192
"""Largest block (cells of one unit's tables at one level) whose dense operators are precomputed."""
MAX_BLOCK_CONSTRAINTS = 4096


@dataclass(frozen=True)
class UnitTable:
    """A count table as post-processing sees it: its dimensions (geography first, if any), its per-cell
    noise variance (0: an invariant), and what produced it."""

    name: str
    query: str
    kind: str  # hierarchy | marginals | histogram
    dims: tuple[Dimension, ...]
    variance: float

    @property
    def n_cells(self) -> int:
        return math.prod(map(int, [d.size for d in self.dims])) if self.dims else 1


@dataclass(frozen=True)
class HierarchyQuery:
    """A hierarchy: its tables coarse to fine, their levels, and whether it is crossed with `by`."""

    name: str
    tables: tuple[str, ...]
    levels: tuple[str, ...]
    by: bool


@dataclass(frozen=True)
class MarginalsQuery:
    """A marginals query within a level: its tables, that level, the integer path it takes ('joint',
    'fitted_tables' or 'tables'), and the hierarchy table whose integers give the unit totals (or None:
    the estimate rounded)."""

    name: str
    tables: tuple[str, ...]
    level: str
    path: str
    totals_from: str | None


@dataclass(frozen=True)
class BlockTable:
    """One table's cells of a unit inside the unit's block: where they start and their attribute shape."""

    table: UnitTable
    offset: int
    shape: tuple[int, ...]
    attributes: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(map(int, self.shape)) if self.shape else 1


@dataclass
class Level:
    """One level of the tree: its units, their parents, and the block of tables every unit holds there,
    with the block's operators (all structural, the same for every unit of the level):
      correction   y -> V C^T W C y, so that y - correction(y) is the block's own least-squares estimate
      total        cells of the reference table summed per copy cell: the block's estimate of its total
      gain         (cells x copies) K = P G (G^T P G)^-1: how the block moves when its total moves
      total_var    (copies,) variance of the block's own total estimate (inf: no tables at this level)
      cell_var     (cells,) the diagonal of P, the block estimate's covariance
    """

    index: int
    name: str
    units: int
    parent: np.ndarray | None
    tables: tuple[BlockTable, ...]
    size: int
    copies: int
    variance: np.ndarray = field(repr=False)
    constraints: sp.csr_matrix | None = field(repr=False, default=None)
    multipliers: np.ndarray | None = field(repr=False, default=None)
    total: sp.csr_matrix | None = field(repr=False, default=None)
    gain: np.ndarray | None = field(repr=False, default=None)
    total_var: np.ndarray | None = field(repr=False, default=None)
    cell_var: np.ndarray | None = field(repr=False, default=None)

    def table(self, name: str) -> BlockTable:
        return next(b for b in self.tables if b.table.name == name)


@dataclass
class UnitTree:
    geography: GeographyDomain | None
    levels: list[Level]
    copy_attributes: tuple[str, ...]
    copies: int
    tables: dict[str, UnitTable]
    hierarchies: tuple[HierarchyQuery, ...]
    marginals: tuple[MarginalsQuery, ...]

    def level_of(self, table: str) -> Level:
        return next(level for level in self.levels if any(b.table.name == table for b in level.tables))


def _level(table: UnitTable, geographies: dict[str, GeographyDomain]) -> str:
    return next((d.level for d in table.dims if d.column in geographies), NATION)


def _attributes(table: UnitTable, geographies) -> list[Dimension]:
    return [d for d in table.dims if d.column not in geographies]


def decomposition_problem(tables: list[UnitTable], geographies: dict[str, GeographyDomain],
                          hierarchies: list[HierarchyQuery]) -> str | None:
    """Why these count tables do not form a tree of geographic units (None: they do)."""
    columns = sorted({d.column for t in tables for d in t.dims if d.column in geographies})
    if len(columns) > 1:
        return f"count tables use {len(columns)} geography columns ({', '.join(columns)})"
    for t in tables:
        positions = [i for i, d in enumerate(t.dims) if d.column in geographies]
        if positions and positions != [0]:
            return f"table {t.name} has its geography dimension after its attributes"
    attribute_sets = [{d.column for d in _attributes(t, geographies)} for t in tables]
    copies = set.intersection(*attribute_sets) if attribute_sets else set()
    for (a, sa), (b, sb) in itertools.combinations(zip(tables, attribute_sets), 2):
        shared = (sa & sb) - copies
        if _level(a, geographies) != _level(b, geographies) and shared:
            return (f"tables {a.name} ({_level(a, geographies)}) and {b.name} ({_level(b, geographies)}) share "
                    f"attributes {sorted(shared)} across geography levels")
    geo = geographies[columns[0]] if columns else None
    levels = _tree_levels(tables, geographies, geo)
    for h in hierarchies:
        positions = [levels.index(level) for level in h.levels]
        if positions != list(range(positions[0], positions[0] + len(positions))):
            skipped = [lvl for lvl in levels[positions[0]:positions[-1] + 1] if lvl not in h.levels]
            return f"hierarchy {h.name} skips the level(s) {skipped} that other tables use"
    return None


def _tree_levels(tables, geographies, geo: GeographyDomain | None) -> list[str]:
    used = {_level(t, geographies) for t in tables} | {NATION}
    return sorted(used, key=lambda lvl: geo.width(lvl) if geo else 0)


def decompose(tables: list[UnitTable], geographies: dict[str, GeographyDomain], hierarchies: list[HierarchyQuery],
              marginals: list[MarginalsQuery]) -> UnitTree:
    """The tree of units of these count tables (ValueError naming the reason when they do not form one)."""
    problem = decomposition_problem(tables, geographies, hierarchies)
    if problem:
        raise ValueError(problem)
    columns = sorted({d.column for t in tables for d in t.dims if d.column in geographies})
    geo = geographies[columns[0]] if columns else None
    attribute_sets = [{d.column for d in _attributes(t, geographies)} for t in tables]
    copy_names = sorted(set.intersection(*attribute_sets)) if attribute_sets else []
    copy_sizes = {d.column: d.size for t in tables for d in _attributes(t, geographies)}
    copies = math.prod(map(int, [copy_sizes[c] for c in copy_names])) if copy_names else 1
    names = _tree_levels(tables, geographies, geo)
    levels = []
    for index, name in enumerate(names):
        at_level = [t for t in tables if _level(t, geographies) == name]
        units = geo.level_size(name) if geo and name != NATION else 1
        parent = None
        if index:
            parent = geo.parent_of(name, names[index - 1]) if names[index - 1] != NATION \
                else np.zeros(units, dtype=np.int64)
        levels.append(_build_level(index, name, units, parent, at_level, geographies, copy_names, copies))
    return UnitTree(geo, levels, tuple(copy_names), copies, {t.name: t for t in tables}, tuple(hierarchies),
                    tuple(marginals))


def _build_level(index: int, name: str, units: int, parent, tables: list[UnitTable], geographies,
                 copy_names: list[str], copies: int) -> Level:
    blocks, offset = [], 0
    for t in tables:
        attributes = _attributes(t, geographies)
        shape = tuple(d.size for d in attributes)
        blocks.append(BlockTable(t, offset, shape, tuple(d.column for d in attributes)))
        offset += math.prod(map(int, shape)) if shape else 1
    if offset > MAX_BLOCK_CELLS:
        raise ValueError(f"the tables at level {name} hold {offset:,} cells per unit, over {MAX_BLOCK_CELLS:,}")
    level = Level(index, name, units, parent, tuple(blocks), offset, copies,
                  np.concatenate([np.full(b.size, float(b.table.variance)) for b in blocks]) if blocks else np.zeros(0))
    if not blocks:
        level.total_var = np.full(copies, np.inf)
        return level
    local = [CountTable(b.table.name, tuple(d for d in b.table.dims if d.column not in geographies), b.table.variance)
             for b in blocks]
    constraints = constraint_matrix(local, {})
    V = level.variance
    if constraints.shape[0]:
        if constraints.shape[0] > MAX_BLOCK_CONSTRAINTS:
            raise ValueError(f"the tables at level {name} link by {constraints.shape[0]:,} constraints per unit, "
                             f"over {MAX_BLOCK_CONSTRAINTS:,}")
        dense = constraints.toarray()
        level.constraints = constraints
        level.multipliers = np.linalg.pinv((dense * V) @ dense.T, rcond=1e-12, hermitian=True)
        projected = np.diag(V) - (V[:, None] * dense.T) @ level.multipliers @ (dense * V)
    else:
        projected = np.diag(V)
    level.total = _total_matrix(blocks[0], copy_names, copies, offset)
    spread = (level.total @ projected).T  # P G (cells x copies)
    total_var = np.asarray(level.total @ spread).reshape(copies, copies).diagonal().copy()
    total_var = np.maximum(total_var, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        level.gain = np.where(total_var > 0, np.asarray(spread) / np.where(total_var > 0, total_var, 1.0), 0.0)
    level.total_var = total_var
    level.cell_var = np.maximum(np.diagonal(projected).copy(), 0.0)
    return level


def _total_matrix(block: BlockTable, copy_names: list[str], copies: int, size: int) -> sp.csr_matrix:
    """G^T: sums the reference table's cells of a unit into its copy cells (copies x block cells)."""
    coordinates = unravel_cells(block.shape) if block.shape else []
    index = np.zeros(block.size, dtype=np.int64)
    for column in copy_names:
        axis = block.attributes.index(column)
        index = index * block.shape[axis] + coordinates[axis]
    cells = block.offset + np.arange(block.size)
    return sp.csr_matrix((np.ones(block.size), (index, cells)), shape=(copies, size))

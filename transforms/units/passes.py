"""The up and down passes over a whole tree, level by level, each level in batches of units.

`estimate_tree` is what an engine does with the kernels of `estimate`: the up pass leaves first (a unit
needs its children's subtree estimates), the down pass root first (a unit needs its parent's final
total). Batches hold whole sibling groups in the down pass; any batch size gives the same bits.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .estimate import combine_up, final_estimate, final_variances, own_estimate, split_down, sum_by_parent
from .tree import Level, UnitTree


@dataclass
class LevelState:
    """What the up pass leaves for the down pass at one level (per unit, rows)."""

    block: np.ndarray        # the block's own estimate (units x cells)
    own_total: np.ndarray    # its total (units x copies)
    subtree: np.ndarray      # subtree estimate of the total (units x copies)
    subtree_var: np.ndarray  # its variance (units x copies)


def blocks_of(tree: UnitTree, noisy: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Per level, the units' blocks (units x block cells): each table's cells of a unit, in block order."""
    out = []
    for level in tree.levels:
        parts = [np.asarray(noisy[b.table.name], dtype=np.float64).reshape(level.units, b.size) for b in level.tables]
        out.append(np.concatenate(parts, axis=1) if parts else np.zeros((level.units, 0)))
    return out


def _batches(count: int, size: int):
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def up_pass(tree: UnitTree, blocks: list[np.ndarray], batch: int = 4096) -> list[LevelState]:
    """Leaves first: every unit's own block estimate and its subtree estimate of its total."""
    states: list[LevelState | None] = [None] * len(tree.levels)
    below: tuple[np.ndarray, np.ndarray] | None = None
    for level in reversed(tree.levels):
        block, own_total, subtree, subtree_var = (np.zeros((level.units, n)) for n in
                                                  (level.size, level.copies, level.copies, level.copies))
        for rows in _batches(level.units, batch):
            if level.size:
                block[rows], own_total[rows] = own_estimate(level, blocks[level.index][rows])
            children = None if below is None else (below[0][rows], below[1][rows])
            subtree[rows], subtree_var[rows] = combine_up(own_total[rows], level.total_var, *(children or (None, None)))
        states[level.index] = LevelState(block, own_total, subtree, subtree_var)
        if level.index:
            below = (sum_by_parent(subtree, level.parent, tree.levels[level.index - 1].units),
                     sum_by_parent(subtree_var, level.parent, tree.levels[level.index - 1].units))
    return states


def down_pass(tree: UnitTree, states: list[LevelState], batch: int = 4096):
    """Root first: every unit's final total and its variance, its block's final estimate and per-cell
    variances. Yields (level, final block estimate, final block variances, final totals) level by level."""
    parent_final = parent_var = None
    for level in tree.levels:
        state = states[level.index]
        if level.parent is None:
            final, final_var = state.subtree.copy(), state.subtree_var.copy()
        else:
            parents = tree.levels[level.index - 1].units
            sibling_sum = sum_by_parent(state.subtree, level.parent, parents)
            sibling_var = sum_by_parent(state.subtree_var, level.parent, parents)
            final, final_var = np.empty_like(state.subtree), np.empty_like(state.subtree)
            for rows in _sibling_batches(level, batch):
                final[rows], final_var[rows] = split_down(state.subtree[rows], state.subtree_var[rows],
                                                          level.parent[rows], parent_final, parent_var,
                                                          sibling_sum, sibling_var)
        estimate = final_estimate(level, state.block, state.own_total, final) if level.size else state.block
        variance = final_variances(level, final_var) if level.size else state.block
        yield level, estimate, variance, final
        parent_final, parent_var = final, final_var


def _sibling_batches(level: Level, batch: int):
    """Slices of about `batch` units that never split a parent's children (children of a parent are
    adjacent: units are ordered by code, and a code's parent is its prefix)."""
    start = 0
    while start < level.units:
        stop = min(start + batch, level.units)
        while stop < level.units and level.parent[stop] == level.parent[stop - 1]:
            stop += 1
        yield slice(start, stop)
        start = stop


def estimate_tree(tree: UnitTree, noisy: dict[str, np.ndarray], batch: int = 4096
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The least-squares estimate of every count table of the tree and its per-cell variances (flat, in
    the tables' cell order)."""
    states = up_pass(tree, blocks_of(tree, noisy), batch)
    estimates, variances = {}, {}
    for level, estimate, variance, _ in down_pass(tree, states, batch):
        for b in level.tables:
            estimates[b.table.name] = estimate[:, b.offset:b.offset + b.size].ravel()
            variances[b.table.name] = variance[:, b.offset:b.offset + b.size].ravel()
    return estimates, variances


def total_variances(tree: UnitTree) -> list[np.ndarray]:
    """Per level, each unit's final total variance (units x copies): both passes on the variances alone
    (they never depend on the values), the same operations as `up_pass`/`down_pass` and the kernels, so
    the same bits. Memory: a few floats per unit, none per cell."""
    subtree_var: list[np.ndarray] = [np.empty(0)] * len(tree.levels)
    below = None
    for level in reversed(tree.levels):
        zeros = np.zeros((level.units, level.copies))
        subtree_var[level.index] = combine_up(zeros, level.total_var, None if below is None else np.zeros_like(below),
                                              below)[1]
        if level.index:
            below = sum_by_parent(subtree_var[level.index], level.parent, tree.levels[level.index - 1].units)
    finals, parent_var = [], None
    for level in tree.levels:
        if level.parent is None:
            final_var = subtree_var[0].copy()
        else:
            parents = tree.levels[level.index - 1].units
            sibling_var = sum_by_parent(subtree_var[level.index], level.parent, parents)
            zeros = np.zeros((level.units, level.copies))
            final_var = split_down(zeros, subtree_var[level.index], level.parent, np.zeros((parents, level.copies)),
                                   parent_var, np.zeros((parents, level.copies)), sibling_var)[1]
        finals.append(final_var)
        parent_var = final_var
    return finals


class TreeVariances(Mapping):
    """Per-cell variances of the tree estimate, table by table, computed on demand from each unit's final
    total variance (`total_variances`): `cells(name, start, stop)` costs that range only, so a release of
    any size is summarised or checked a part at a time. Public: from the plan's structure and noise only."""

    def __init__(self, tree: UnitTree):
        self.tree = tree
        self.finals = total_variances(tree)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.cells(name, 0, self.tree.tables[name].n_cells)

    def __iter__(self):
        return iter(self.tree.tables)

    def __len__(self) -> int:
        return len(self.tree.tables)

    def __contains__(self, name: object) -> bool:  # (Mapping's computes the whole table to answer)
        return name in self.tree.tables

    def cells(self, name: str, start: int, stop: int) -> np.ndarray:
        """Variances of cells [start, stop) of table `name`, in the table's cell order."""
        level = self.tree.level_of(name)
        block = level.table(name)
        first, last = start // block.size, -(-stop // block.size)
        rows = final_variances(level, self.finals[level.index][first:last]) if level.size else np.zeros((last - first, 0))
        flat = rows[:, block.offset:block.offset + block.size].ravel()
        return flat[start - first * block.size:stop - first * block.size]

    def largest(self, name: str, chunk_cells: int = 1 << 22) -> float:
        """The largest variance over the table's cells, a chunk of units at a time."""
        size = self.tree.tables[name].n_cells
        step = max(1, chunk_cells // max(1, self.tree.level_of(name).table(name).size)) * \
            self.tree.level_of(name).table(name).size
        return max(float(self.cells(name, a, min(a + step, size)).max()) for a in range(0, size, step))


def _slice(state, rows: slice):
    """Rows of an UpState or DownState."""
    from .kernels import DownState, UpState

    if isinstance(state, UpState):
        return UpState(state.block[rows], state.own_total[rows], state.subtree[rows], state.subtree_var[rows])
    return DownState(state.final[rows], state.final_var[rows], {k: v[rows] for k, v in state.integers.items()})


def _concat(parts):
    """Rows of several DownStates / LevelOutputs, in order."""
    from .kernels import DownState, LevelOutput

    if isinstance(parts[0], DownState):
        return DownState(np.concatenate([p.final for p in parts]), np.concatenate([p.final_var for p in parts]),
                         {k: np.concatenate([p.integers[k] for p in parts]) for k in parts[0].integers})
    return LevelOutput(*({k: np.concatenate([getattr(p, field)[k] for p in parts]) for k in getattr(parts[0], field)}
                         for field in ("estimates", "variances", "published")))


def down_job(tree: UnitTree, job) -> tuple:
    """One group's down step: `job` = (level index, parents' DownState, children's UpState, children's noisy
    blocks, each child's parent row)."""
    from .kernels import down_group

    index, parents, children, noisy, child_parent = job
    return down_group(tree, tree.levels[index], parents, children, noisy, child_parent)


def run_tree(tree: UnitTree, blocks: list[np.ndarray], transitions, mapper=None):
    """Both passes and the integer step over the whole tree; yields (level, LevelOutput) root first, each
    level's output the concatenation of its groups' (`transitions`: `groups.transitions(tree)`;
    `mapper(jobs) -> results`: runs the groups' down steps (`down_job`), in order, default here)."""
    from .kernels import root, up_group

    states = [None] * len(tree.levels)
    for level in reversed(tree.levels):
        below = level.index + 1 < len(tree.levels)
        states[level.index] = up_group(level, blocks[level.index], states[level.index + 1] if below else None,
                                       tree.levels[level.index + 1].parent if below else None)
    down, output = root(tree, states[0], blocks[0])
    yield tree.levels[0], output
    mapper = mapper or (lambda jobs: [down_job(tree, job) for job in jobs])
    for transition in transitions:
        level = tree.levels[transition.index]
        jobs = []
        for g in range(transition.count):
            parents = slice(int(transition.parent_start[g]), int(transition.parent_start[g + 1]))
            children = slice(int(transition.child_start[g]), int(transition.child_start[g + 1]))
            jobs.append((level.index, _slice(down, parents), _slice(states[level.index], children),
                         blocks[level.index][children], level.parent[children] - parents.start))
        results = list(mapper(jobs))
        down = _concat([r[0] for r in results])
        yield level, _concat([r[1] for r in results])

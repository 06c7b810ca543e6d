"""How the units of each level are grouped for the passes: a public function of the tree alone.

The down pass from level i-1 to level i needs, in one place, a parent and all of its children (their
final totals share the parent's, their integers add up to the parent's), so its unit of work is a group
of consecutive parents and all their children, sized so that the children's work (their cells and their marginals' joint cells) is at
most `budget` (a parent whose children alone exceed it forms a group of its own). The up pass into level i-1 uses the
same groups. A group is also the part in which the children's tables are written (tables/NAME/part-K),
so every engine writes the same files. Units are in code order, so a group's children are a contiguous
range of the level below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .tree import UnitTree

GROUP_WORK = 2_000_000
"""Work per group: the children's cells plus the cells of their marginals' joint tables (a few hundred MiB
of arrays at most): what a worker holds for one group, and the grain of parallelism."""


@dataclass(frozen=True)
class Transition:
    """The groups of the pass between level `index - 1` (parents) and level `index` (children)."""

    index: int
    parent_start: np.ndarray  # first parent of each group, and the number of parents last
    child_start: np.ndarray   # first child of each group, and the number of children last

    @property
    def count(self) -> int:
        return self.parent_start.size - 1

    def group_of_parent(self) -> np.ndarray:
        return np.repeat(np.arange(self.count), np.diff(self.parent_start))

    def group_of_child(self) -> np.ndarray:
        return np.repeat(np.arange(self.count), np.diff(self.child_start))


def unit_work(tree: UnitTree, level_index: int) -> int:
    """Work of one unit of a level: its block's cells and the joint cells of its marginals."""
    level = tree.levels[level_index]
    joints = sum(_joint_cells(level, m.tables) for m in tree.marginals if m.level == level.name)
    return max(level.size, 1) + joints


def _joint_cells(level, tables) -> int:
    sizes = {}
    for name in tables:
        block = level.table(name)
        sizes.update(zip(block.attributes, block.shape))
    return math.prod(map(int, list(sizes.values()))) if sizes else 1


def transitions(tree: UnitTree, budget: int = GROUP_WORK) -> list[Transition]:  # noqa: B008
    """Per level below the root, the groups of its pass (see the module docstring)."""
    out = []
    for level in tree.levels[1:]:
        parents = tree.levels[level.index - 1].units
        children = np.bincount(level.parent, minlength=parents)
        first_child = np.concatenate([[0], np.cumsum(children)])
        cells = children * unit_work(tree, level.index)
        parent_start, running = [0], 0
        for p in range(parents):
            if running and running + cells[p] > budget:
                parent_start.append(p)
                running = 0
            running += cells[p]
        parent_start.append(parents)
        starts = np.asarray(parent_start, dtype=np.int64)
        out.append(Transition(level.index, starts, first_child[starts]))
    return out

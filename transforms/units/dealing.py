"""Dealing a new attribute's values to the records of each separator value: evenly, not at random.

Records are drawn along a junction tree clique by clique: the records holding separator value s (in their
unit) receive the new attribute's values in the counts the clique's integer table gives. Which record gets
which value is free; the model says the new attribute is independent of the attributes already drawn given s.
A shuffle realises that in expectation, with hypergeometric noise in every table that pairs the new attribute
with an earlier one (on Adult, records along AIM's junction tree at epsilon 3: 0.059 mean 2-way error against
the model's own 0.053).

Here the records of s are sorted by their earlier attributes (the largest domain first, ties broken at random)
and the values are dealt by systematic sampling along that order: value v's n_v records sit at positions
(k + u_v) / n_v, k < n_v, on a circle of circumference 1 (u_v uniform on [0, 1)), read from a uniformly drawn
start. Every arc of the circle, so every run of consecutive records, then holds each value v within
1 + width x n_v / N records of its share (width: the new cells; usually one or two), so the records sharing the
first key's value get the new attribute in proportion, and later keys' values nearly so. The uniform start makes
every record equally likely to get each of the group's values, so the expected count of every (earlier values,
new value) cell is exactly the model's, as with a shuffle; its spread is bounded per run instead of growing with
the run's length.
Measured (benchmarks/synthetic_adult.py's metric; the same releases synthesized both ways in one process, 2-3
keys, 2 public seeds each), AIM's records on Adult, 2-way / 3-way error: 0.0580 -> 0.0563 / 0.1471 -> 0.1427 at
epsilon 3, 0.0764 -> 0.0746 / 0.1779 -> 0.1734 at 1, 0.1265 -> 0.1246 / 0.2506 -> 0.2460 at 0.3; MST's 2-way
0.0863 -> 0.0841, 0.1003 -> 0.0985, 0.1419 -> 0.1404. Keys in drawing order, in the reverse, in an order drawn
from the seed, or smallest first were 0.0002-0.0006 worse than largest first; a serpentine order (each key
reversed under every other value of the keys before it) no better. A unit's records dealt to its sub-units
(`dealt_blocks`, synthesize's split) on the 1M-row country release: the records' tract x age tables 0.846 ->
0.682 L1 over the population against the truth, tract x age x sex 1.116 -> 1.008.
Tried and not used (2026-11-29): herding (each record, in a random order, to the value its earlier values'
targets most need, a C kernel). It kept every table with an earlier attribute within a few records of the model
in one group, and lowered AIM's records' error on Adult by 1-3% (0.0562 -> 0.0544 at epsilon 3), but it is
biased: a record holding a value rare in its group is pulled toward the commonest new value whenever earlier
attributes are correlated (the test with k identical attributes: 0.57 at k = 2, 0.75 at k = 10 against the
model's 0.5), and summed over many small groups (units x separator values at a country's scale) its 2-way tables
were 10-15x further from the model than this deal's (and 10-13x than a shuffle's). An unbiased balanced deal
(the cube method, Deville and Tille 2004) is the way to that accuracy; the deal here is unbiased by construction.
Post-processing: published tables and a public seed only.
"""
from __future__ import annotations

import numpy as np


def dealt_cells(group: np.ndarray, counts: np.ndarray, earlier: list[tuple[np.ndarray, int]],
                rng: np.random.Generator) -> np.ndarray:
    """Each record's new cell: `group` numbers each record's (unit, separator value) as the rows of `counts`
    (groups x new cells: how many records of the group get each cell; every row adds up to its group's records),
    `earlier` holds (codes per record, public domain size) of the attributes drawn before outside the separator,
    the one to balance best first (`by_domain`). The records tabulate to `counts` exactly."""
    groups, width = counts.shape
    return dealt_blocks(group, np.repeat(np.arange(groups), width), counts.ravel(), earlier, rng) % width


def dealt_blocks(group: np.ndarray, block_group: np.ndarray, block_counts: np.ndarray,
                 earlier: list[tuple[np.ndarray, int]], rng: np.random.Generator) -> np.ndarray:
    """Each record's block: block i (in any order) to receive `block_counts[i]` records of group `block_group[i]`
    (a group's blocks add up to its records, and every record lands in a block of its own group: both checked).
    `dealt_cells` with blocks of any number per group (a unit's sub-units, say)."""
    block_counts = np.asarray(block_counts, dtype=np.int64)
    block_group = np.asarray(block_group, dtype=np.int64)
    groups = int(max(group.max(initial=-1), block_group.max(initial=-1))) + 1
    records = np.bincount(block_group, weights=block_counts, minlength=groups).astype(np.int64)
    if not np.array_equal(np.bincount(group, minlength=groups), records):
        raise ValueError("dealt_blocks: a group's blocks do not add up to its records")
    slots = _systematic(block_group, block_counts, groups, rng)
    first = np.cumsum(records) - records
    shift = rng.integers(0, np.maximum(records, 1))  # a uniform start on each group's circle
    owner = np.repeat(np.arange(groups), records)
    target = np.arange(slots.size) - first[owner]
    target += shift[owner]
    target %= records[owner]
    target += first[owner]
    del owner
    rotated = np.empty_like(slots)
    rotated[target] = slots
    del slots, target
    dealt = np.empty(group.size, dtype=np.int64)
    dealt[_record_order(group, groups, earlier, rng)] = rotated
    if not np.array_equal(block_group[dealt], group):  # an earlier code outside its size sorts into another group
        raise ValueError("dealt_blocks: a record was dealt a block of another group (an earlier code outside its size)")
    return dealt


def _systematic(block_group: np.ndarray, block_counts: np.ndarray, groups: int, rng: np.random.Generator
                ) -> np.ndarray:
    """Per group, its blocks' records in the order of their positions (k + u_b) / n_b on the group's circle
    (u_b uniform per block): the block of each slot, groups one after the other. A position sorts as a fraction of
    as many bits as fit beside the group's number in one int64 key (45 for 131,072 groups, at most 52): near-ties
    below that go to the lower block, which changes no count."""
    bits = min(52, 62 - max(groups, 1).bit_length())
    block = np.repeat(np.arange(block_counts.size), block_counts)
    position = (np.arange(block.size) - (np.cumsum(block_counts) - block_counts)[block]).astype(np.float64)
    position += rng.random(block_counts.size)[block]
    position /= block_counts[block]
    position *= 2.0 ** bits
    key = np.minimum(np.floor(position, out=position), 2.0 ** bits - 1).astype(np.int64)
    del position
    key |= block_group[block] << bits
    return block[np.argsort(key, kind="stable")]


def _record_order(group: np.ndarray, groups: int, earlier: list[tuple[np.ndarray, int]],
                  rng: np.random.Generator) -> np.ndarray:
    """The records sorted by group, then by the earlier attributes' codes (first key first), ties in a random
    order: one int64 key while the product of the public sizes fits, a lexicographic sort of the rest."""
    key, span, rest = group.astype(np.int64), groups, []
    for codes, size in earlier:
        size = int(size)  # a Python integer: the span's test must not wrap
        if not rest and span * size < 2 ** 62:
            key, span = key * size + codes, span * size
        else:
            rest.append(codes)
    shuffled = rng.permutation(group.size)
    if rest:
        return shuffled[np.lexsort([*[codes[shuffled] for codes in rest[::-1]], key[shuffled]])]
    key = key[shuffled]
    return shuffled[np.argsort(key, kind="stable")]


def by_domain(codes: dict[str, np.ndarray], sizes: dict[str, int], separator: tuple[str, ...]
              ) -> list[tuple[np.ndarray, int]]:
    """(codes, size) of the earlier attributes outside `separator`, the largest public domain first (ties:
    drawing order)."""
    earlier = [a for a in codes if a not in separator]
    return [(codes[a], sizes[a]) for a in sorted(earlier, key=lambda a: -sizes[a])]

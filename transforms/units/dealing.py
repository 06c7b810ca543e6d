"""Dealing a new attribute's values to the records of each separator value: evenly, not at random.

Records are drawn along a junction tree clique by clique: the records holding separator value s (in their
unit) receive the new attribute's values in the counts the clique's integer table gives. Which record gets
which value is free; the model says the new attribute is independent of the attributes already drawn given s.
A shuffle realises that in expectation, with hypergeometric noise in every table that pairs the new attribute
with an earlier one (on Adult, records along AIM's junction tree at epsilon 3: 0.059 mean 2-way error against
the model's own 0.053).

`dealt_cells` (the records' new values) herds: the records of s, in a random order, each get the value (among
those with records left to give) that the tables pairing an earlier attribute with the new one most need among
the records left: for each earlier attribute j with the record's value a_j, the records of (s, a_j) the value
still needs to reach its share (the model's expectation, holding_j(a_j) x n_v / N) as a fraction of the records
of (s, a_j) not dealt yet, summed over j and the group itself (C kernel `_dealing.herd`). Every (earlier value,
new value) cell then ends within about two records of the model's expectation, for every earlier attribute at
once (tested: at most 1.8 on a case where the systematic deal below reaches 3.1 on its second key and a shuffle
far more). The price: the expected count of a cell is the model's only up to a small bias (at most 0.15 record
a cell in that test, against 1.8 of a run's deviation), since the deal is a deterministic function of a random
order.

`dealt_blocks` (a unit's records to its sub-units, any number of them per unit) deals systematically: the
records sorted by their earlier attributes (the largest domain first, ties broken at random), block b's n_b
records at positions (k + u_b) / n_b, k < n_b, on a circle of circumference 1 (u_b uniform on [0, 1)), read
from a uniformly drawn start. Every run of consecutive records then holds each block within 1 + width x n_b / N
records of its share, so the records sharing the first key's value are spread in proportion and later keys'
values nearly so; every record is equally likely to land in each block, so the expected counts are exactly the
model's. Herding would cost records x attributes x sub-units per unit (a county of thousands of tracts).

Measured (benchmarks/synthetic_adult.py's metric, AIM's records on Adult, 2-way / 3-way error; the same
releases synthesized each way in one process): the systematic deal against a shuffle 0.0580 -> 0.0563 /
0.1471 -> 0.1427 at epsilon 3, 0.0764 -> 0.0746 / 0.1779 -> 0.1734 at 1, 0.1265 -> 0.1246 / 0.2506 -> 0.2460
at 0.3 (2-3 keys, 2 public seeds each); herding against the systematic deal: see the README's figures (5 keys
each). A unit's records dealt to its sub-units (`dealt_blocks`) on the 1M-row country release: the records'
tract x age tables 0.846 -> 0.682 L1 over the population against the truth, tract x age x sex 1.116 -> 1.008.
Post-processing: published tables and a public seed only.
"""
from __future__ import annotations

import numpy as np

from .. import _dealing


def dealt_cells(group: np.ndarray, counts: np.ndarray, earlier: list[tuple[np.ndarray, int]],
                rng: np.random.Generator) -> np.ndarray:
    """Each record's new cell, herded (module docstring): `group` numbers each record's (unit, separator value) as
    the rows of `counts` (groups x new cells: how many records of the group get each cell; every row adds up to
    its group's records; checked), `earlier` holds (codes per record, public domain size) of the attributes drawn
    before outside the separator. The records tabulate to `counts` exactly."""
    groups, width = counts.shape
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    records = np.bincount(group, minlength=groups)
    if records.size != groups or not np.array_equal(counts.sum(axis=1), records):
        raise ValueError("dealt_cells: a group's counts do not add up to its records")
    order = rng.permutation(group.size)
    members = order[np.argsort(group[order], kind="stable")]
    del order
    group_offsets = np.zeros(groups + 1, dtype=np.int64)
    np.cumsum(records, out=group_offsets[1:])
    codes = np.empty((len(earlier), group.size), dtype=np.int32)
    sizes = np.empty(len(earlier), dtype=np.int64)
    for j, (values, size) in enumerate(earlier):
        codes[j], sizes[j] = _dense(np.asarray(values), int(size))
    start = rng.integers(0, max(width, 1), groups)
    cells = np.empty(group.size, dtype=np.int64)
    _dealing.herd(members, group_offsets, np.arange(groups + 1, dtype=np.int64) * width, counts.ravel(), codes,
                  sizes, start, cells)
    return cells


HERD_SIZE = 1 << 16
"""The largest domain whose codes the herding kernel takes as they are (its tables hold size x width counts); a
larger one is renumbered by the values present first."""


def _dense(codes: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """(codes, size) as the herding kernel takes them: each code checked within [0, size) (a code outside would
    be another value's), renumbered by the values present when the domain is larger than HERD_SIZE."""
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= size):
        raise ValueError(f"dealt_cells: an earlier code outside its declared size {size}")
    if size <= HERD_SIZE:
        return codes, max(size, 1)
    present, dense = np.unique(codes, return_inverse=True)
    return dense, max(present.size, 1)


def dealt_blocks(group: np.ndarray, block_group: np.ndarray, block_counts: np.ndarray,
                 earlier: list[tuple[np.ndarray, int]], rng: np.random.Generator) -> np.ndarray:
    """Each record's block, dealt systematically (module docstring): block i (in any order) to receive
    `block_counts[i]` records of group `block_group[i]` (a group's blocks add up to its records, and every record
    lands in a block of its own group: both checked); `earlier` as for `dealt_cells`, the one to balance best
    first (`by_domain`)."""
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

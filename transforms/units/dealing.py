"""Dealing a new attribute's values to the records of each separator value: evenly, not at random.

Records are drawn along a junction tree clique by clique: the records holding separator value s (in their
unit) receive the new attribute's values in the counts the clique's integer table gives. Which record gets
which value is free; the model says the new attribute is independent of the attributes already drawn given s.
A shuffle realises that in expectation, with hypergeometric noise in every table that pairs the new attribute
with an earlier one (on Adult, records along AIM's junction tree at epsilon 3: 0.059 mean 2-way error against
the model's own 0.053).

`dealt_cells` (the records' new values) herds (C kernel `_dealing.herd`). Each earlier value a of attribute j
in group s gets a target row: the model's expectation holding_j(a) x n_v / N rounded systematically from a random
phase (integers adding up to holding_j(a), each with expectation exactly the model's). The records of s, in a
random order, each get the value (among those with records left to give) that the targets most need among the
records left: for each earlier attribute j, the records of (s, a_j) still owed value v as a share of those of
them not dealt yet, summed over j and the group itself. Every (earlier value, new value) cell then ends within a
few records of the model's expectation for every earlier attribute at once (at most 3.3 over 100 seeds with 4
earlier attributes, where the systematic deal below reaches 12 on the attributes it sorts last; 4.6-7.6 with 10,
against 7.4-15), and the expected counts are the model's (tested within sampling error; targets of the real-valued
shares instead gave the records of a value rare in every group the commonest new value, a bias adding up over
groups: found by review). Past HERD_WORK or HERD_TABLE_CELLS the deal is systematic.

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
at 0.3 (2-3 keys, 2 public seeds each); herding against the systematic deal (the same 5 releases per epsilon)
0.1264 -> 0.1251 / 0.2498 -> 0.2485, 0.0751 -> 0.0733 / 0.1741 -> 0.1717, 0.0562 -> 0.0544 / 0.1425 -> 0.1396. A unit's records dealt to its sub-units (`dealt_blocks`) on the 1M-row country release: the records'
tract x age tables 0.846 -> 0.682 L1 over the population against the truth, tract x age x sex 1.116 -> 1.008.
Post-processing: published tables and a public seed only.
"""
from __future__ import annotations

import numpy as np

from .. import _dealing


def dealt_cells(group: np.ndarray, counts: np.ndarray, earlier: list[tuple[np.ndarray, int]],
                rng: np.random.Generator) -> np.ndarray:
    """Each record's new cell, herded (module docstring; systematically, as `dealt_blocks`, past HERD_WORK or
    HERD_TABLE_CELLS): `group` numbers each record's (unit, separator value) as the rows of `counts` (groups x
    new cells: how many records of the group get each cell; every row adds up to its group's records; checked),
    `earlier` holds (codes per record, public domain size) of the attributes drawn before outside the separator,
    the one to balance best first (`by_domain`). The records tabulate to `counts` exactly."""
    groups, width = counts.shape
    if not np.issubdtype(counts.dtype, np.integer) or not np.issubdtype(np.asarray(group).dtype, np.integer):
        raise ValueError("dealt_cells: counts and groups must be integers")
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    records = np.bincount(group, minlength=groups)
    if records.size != groups or (counts < 0).any() or not np.array_equal(counts.sum(axis=1), records):
        raise ValueError("dealt_cells: a group's counts do not add up to its records")
    dense = [_dense(np.asarray(values), int(size), group.size) for values, size in earlier]
    tables = sum(size for _, size in dense) * (width + 2)
    if group.size * len(dense) * width > HERD_WORK or tables > HERD_TABLE_CELLS or group.size >= 2 ** 31:
        return dealt_blocks(group, np.repeat(np.arange(groups), width), counts.ravel(), earlier, rng) % width
    order = rng.permutation(group.size)
    members = order[np.argsort(group[order], kind="stable")]
    del order
    group_offsets = np.zeros(groups + 1, dtype=np.int64)
    np.cumsum(records, out=group_offsets[1:])
    codes = np.empty((len(dense), group.size), dtype=np.int32)
    for j, (values, _) in enumerate(dense):
        codes[j] = values
    sizes = np.array([size for _, size in dense], dtype=np.int64)
    start = rng.integers(0, max(width, 1), groups)
    phases = int(rng.integers(0, 2 ** 63))  # the seed of every earlier value's random phase (`_dealing.phase`)
    cells = np.empty(group.size, dtype=np.int64)
    _dealing.herd(members, group_offsets, np.arange(groups + 1, dtype=np.int64) * width, counts.ravel(), codes,
                  sizes, start, phases, cells)
    return cells


HERD_WORK = 1 << 32
"""The most records x earlier attributes x new cells a herded deal may score (about 4 s of the kernel); a
larger deal is systematic (`dealt_blocks`): 10M records with 10 earlier attributes and a 100-value new attribute
took 40 s herded against 3 s."""

HERD_TABLE_CELLS = 1 << 26
"""The most int32 entries the kernel's tables may hold (256 MiB: each earlier value x (the new cells + 2));
a larger deal is systematic."""

HERD_SIZE = 1 << 16
"""The largest domain whose codes the herding kernel takes as they are; a larger one is renumbered by the values
present first."""


def _dense(codes: np.ndarray, size: int, records: int) -> tuple[np.ndarray, int]:
    """(codes, size) as the herding kernel takes them: integer codes, one per record, each checked within [0, size)
    (a code outside would be another value's), renumbered by the values present when the domain is larger than
    HERD_SIZE."""
    if not np.issubdtype(codes.dtype, np.integer) or codes.shape != (records,):
        raise ValueError("dealt_cells: an earlier attribute's codes must be integers, one per record")
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= size):
        raise ValueError(f"dealt_cells: an earlier code outside its declared size {size}")
    if size <= HERD_SIZE:
        return codes, max(size, 1)
    present, dense = np.unique(codes, return_inverse=True)
    return dense.reshape(-1), max(present.size, 1)


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

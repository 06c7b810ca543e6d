"""Contribution bounding: keep at most k records per privacy unit, chosen uniformly by a keyed PRF.

Privacy: after `bound_contributions`, every unit has at most k records, which is what the
count sensitivity in `dprelease.accounting.sensitivity` assumes. Grouping is exact (by the
unit's value, not a hash). The k kept records are those with the smallest keyed priority
PRF(key, unit, record, duplicate index): a uniformly random k-subset of the unit's records.
Identical records of a unit are interchangeable, so the kept *multiset* does not depend on
input order: the same key and input give the same tables on every engine.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from .csprng import prf_blocks
from .encode import text_as_bytes
from .segments import run_positions

_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """A fast public bijective mixer on uint64 (not a secret: used for partitioning only)."""
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def unit_fingerprints(units: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A stable uint64 per unit value: the value itself for integers, BLAKE2b-64 for others.

    Used as PRF input and for spill partitioning, never for grouping.
    """
    if pa.types.is_integer(units.type):  # bit view of the exact 64-bit value
        return _wide_integers(units).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    encoded = pc.dictionary_encode(units)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    digests = [
        int.from_bytes(hashlib.blake2b(_unit_bytes(v), digest_size=8).digest(), "little")
        for v in text_as_bytes(encoded.dictionary).to_pylist()
    ]
    table = np.array(digests + [0], dtype=np.uint64)
    return table[encoded.indices.fill_null(len(digests)).to_numpy(zero_copy_only=False)]


def _wide_integers(units: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Integer units as uint64 (unsigned) or int64 (signed): every value of the type fits exactly."""
    return units.cast(pa.uint64() if pa.types.is_unsigned_integer(units.type) else pa.int64())


def _unit_bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def unit_shards(units: pa.Array | pa.ChunkedArray, shards: int, salt: int) -> np.ndarray:
    """The shard (0..shards-1) of each record's unit: a keyed mix of the unit's fingerprint, so the
    assignment is not predictable from the data alone (no crafted units piling into one shard).
    Used to bring a unit's records together (spill partitions, Beam shards), never for grouping."""
    with np.errstate(over="ignore"):
        mixed = splitmix64(unit_fingerprints(units) ^ np.uint64(salt))
    return (mixed % np.uint64(shards)).astype(np.int64)


def shard_pieces(table: pa.Table, shard: np.ndarray, shards: int) -> Iterator[tuple[int, pa.Table]]:
    """(shard, the records of `table` in it, in their order) for each of the `shards` that holds records, as
    compact copies (a slice would carry its parent's buffers). With `shard` from `unit_shards`, every record of a
    unit is in one piece: the one splitter of the embedded engine's spill, Spark's blobs and Beam's shards."""
    narrow = shard.astype(np.uint16) if shards <= 1 << 16 else shard  # a radix sort: 9x faster than int64's
    order = np.argsort(narrow, kind="stable")
    bounds = np.searchsorted(shard[order], np.arange(shards + 1))
    for s in np.flatnonzero(bounds[1:] > bounds[:-1]):
        yield int(s), table.take(pa.array(order[bounds[s]:bounds[s + 1]]))


def shuffled(table: pa.Table) -> bytes:
    """Records as the bytes a shuffle moves (Beam's shard pieces, Spark's blobs): an Arrow IPC stream, its buffers
    zstd-compressed where this pyarrow has zstd (about a third of the bytes of encoded records; `unshuffled` reads
    either)."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd" if pa.Codec.is_available("zstd") else None)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def unshuffled(data) -> pa.Table:
    """The records of `shuffled`'s bytes (bytes or an Arrow buffer)."""
    return pa.ipc.open_stream(data).read_all()


def shard_salt(key) -> int:
    """The 64-bit salt of `unit_shards`, derived from the release key."""
    return int.from_bytes(key.derive("dprelease/shard")[:8], "little")


def dense_unit_ids(units: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Exact grouping: equal unit values get equal dense ids (0..n_units-1)."""
    encoded = pc.dictionary_encode(units)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def records_over_limit(units: pa.Array | pa.ChunkedArray, k: int) -> np.ndarray:
    """Positions of the records whose unit has more than k records (exact, by value).

    Integer units: one sort; a unit exceeds k exactly when sorted[i] == sorted[i + k].
    Other types: exact dictionary grouping and counts.
    """
    n = len(units)
    if n <= k:
        return np.empty(0, dtype=np.int64)
    if pa.types.is_integer(units.type):
        values = _wide_integers(units).to_numpy(zero_copy_only=False)
        ordered = np.sort(values)
        heavy = ordered[k:][ordered[k:] == ordered[:-k]]
        if heavy.size == 0:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(np.isin(values, np.unique(heavy)))
    ids = dense_unit_ids(units)
    return np.flatnonzero(np.bincount(ids)[ids] > k)


def record_keys(codes: list[np.ndarray], sizes: list[int], rows: int) -> np.ndarray:
    """One uint64 per record of `rows` identifying its encoded values (exact mixed radix when it fits; all equal
    when no column is encoded)."""
    total = 1
    for size in sizes:
        total *= size
    key = np.zeros(rows, dtype=np.uint64)
    if total < 2**63:
        for column, size in zip(codes, sizes):
            key = key * np.uint64(size) + column.astype(np.uint64)
        return key
    with np.errstate(over="ignore"):
        for column in codes:
            key = splitmix64(key ^ column.astype(np.uint64))
    return key


def priorities(subkey: bytes, fingerprints: np.ndarray, keys: np.ndarray, duplicate: np.ndarray) -> np.ndarray:
    """PRF(unit, record, duplicate index) as a 2-block CBC-MAC with AES-256 (fixed-length input)."""
    first = prf_blocks(subkey, fingerprints, keys)
    second = prf_blocks(subkey, first[:, 0] ^ duplicate.astype(np.uint64), first[:, 1])
    return second[:, 0].copy()


def bound_contributions(
    units: pa.Array | pa.ChunkedArray, keys: np.ndarray | Callable[[np.ndarray], np.ndarray], k: int, subkey: bytes
) -> np.ndarray:
    """Mask of records kept: all records of units with <= k records; k chosen uniformly otherwise.

    `units` holds each record's (non-null) unit value, grouped exactly; `keys` the records'
    encoded values (`record_keys`), or a function giving those of the records at some positions (called only
    for the records of units over k: when none is, no key is made).
    """
    keep = np.ones(len(units), dtype=bool)
    over = records_over_limit(units, k)
    if over.size == 0:
        return keep
    over_units = units.take(pa.array(over))
    fingerprints = unit_fingerprints(over_units)
    units, rec = dense_unit_ids(over_units), keys(over) if callable(keys) else keys[over]
    order = np.lexsort((rec, units))
    duplicate = np.empty(over.size, dtype=np.int64)
    duplicate[order] = run_positions(units[order], rec[order])
    priority = priorities(subkey, fingerprints, rec, duplicate)
    order = np.lexsort((priority, units))
    rank = np.empty(over.size, dtype=np.int64)
    rank[order] = run_positions(units[order])
    keep[over] = rank < k
    return keep

"""Encoding input columns to public domain codes, batch by batch.

Privacy: the mapping from values to codes depends on the public domain only; invalid
values (out of domain, null, NaN, unparsable) are routed by the declared policy to the
`other` cell or dropped, never raised as errors, so nothing here depends on data content
in a way that can abort a run or reach a log.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import _encoding
from .domains import CategoricalDomain, Domain, GeographyDomain, IntegerDomain, MeasureDomain

INVALID = -1
LOOKUP_VALUES = 1 << 22
"""A binned integer column's (or a quantile's measure's) range of values up to which a batch holding more values
than the range reads each value's bin (bucket) from a table over the range instead of searching the edges
(candidates): the same codes, found faster."""


def is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def text_as_bytes(array: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A text array as binary (zero-copy, never decoded: invalid UTF-8 in one value cannot raise);
    any other array unchanged."""
    return array.cast(pa.large_binary()) if is_text(array.type) else array


def dictionary_values(dictionary: pa.Array) -> list:
    """The Python values of a column's dictionary; text that is not valid UTF-8 becomes None (an invalid
    value, routed by the column's policy) instead of an error that a single record could raise."""
    if is_text(dictionary.type):
        return [_decoded(v) for v in text_as_bytes(dictionary).to_pylist()]
    return dictionary.to_pylist()


def _decoded(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def dictionary_encoded(column: pa.Array | pa.ChunkedArray) -> pa.DictionaryArray:
    """One dictionary array of a column (already dictionary-typed or encoded here; chunks combined)."""
    encoded = column if pa.types.is_dictionary(column.type) else pc.dictionary_encode(column)
    return encoded.combine_chunks() if isinstance(encoded, pa.ChunkedArray) else encoded


def _lookup_codes(column: pa.Array | pa.ChunkedArray, values: tuple[str, ...], invalid: int = INVALID,
                  dtype: type = np.int64) -> np.ndarray:
    """Codes (positions in `values`) of a column via its dictionary; `invalid` for misses and nulls. A text
    dictionary is matched as bytes against the values' UTF-8 in one vectorised lookup (text that is not valid
    UTF-8 equals no value); any other dictionary value by its text form (`_as_text`). The records' codes are then
    read through that lookup in one pass (`_encoding.codes`)."""
    if len(column) == 0:  # (an empty chunked column of some types cannot be dictionary-encoded)
        return np.empty(0, dtype=dtype)
    encoded = dictionary_encoded(column)
    if is_text(encoded.dictionary.type):
        found = pc.index_in(text_as_bytes(encoded.dictionary), value_set=_utf8_values(values))
        lut = found.fill_null(INVALID).to_numpy(zero_copy_only=False).astype(np.int32)
    else:
        table = {v: i for i, v in enumerate(values)}
        lut = np.array([table.get(_as_text(v), INVALID) for v in dictionary_values(encoded.dictionary)],
                       dtype=np.int32)
    if lut.size == 0:  # no dictionary value: every record is null
        return np.full(len(encoded), invalid, dtype=dtype)
    return _kernel_codes(encoded.indices, 0, lut.size - 1, LOOKUP, lut, invalid, dtype)


IDENTITY, CLAMP, LOOKUP, EDGES = range(4)
"""`_encoding.codes`'s modes: value - minimum; clamped, minus minimum; through a lookup; by searching bin edges."""


def _kernel_codes(column: pa.Array | pa.ChunkedArray, minimum: int, maximum: int, mode: int,
                  table: np.ndarray | None, invalid: int, dtype: type) -> np.ndarray:
    """Codes of a column's values (`_encoding.codes`), chunk by chunk, straight from the Arrow buffers; a
    column of a type the kernel does not read is first made int32, int64 or float64 as numpy would make it."""
    out = np.empty(len(column), dtype=dtype)
    position = 0
    for chunk in column.chunks if isinstance(column, pa.ChunkedArray) else [column]:
        n = len(chunk)
        values, kind = _kernel_values(chunk)
        if values is None:
            out[position:position + n] = invalid
        elif n:
            validity, data = values.buffers()[:2]
            _encoding.codes(data, kind, values.offset, n, validity, values.offset, minimum, maximum, mode, table,
                            invalid, out[position:position + n])
        position += n
    return out


_WIDENED = {pa.int8(): pa.int32(), pa.int16(): pa.int32(), pa.uint8(): pa.int32(), pa.uint16(): pa.int32(),
            pa.uint32(): pa.int64(), pa.float16(): pa.float64(), pa.float32(): pa.float64()}
_KINDS = {pa.int32(): "i", pa.int64(): "q", pa.float64(): "d"}


def _kernel_values(chunk: pa.Array) -> tuple[pa.Array | None, str]:
    """A chunk as an array the kernel reads (int32, int64 or float64, with its validity) and its kind; None for
    a column of nulls. Narrower integers and floats are widened exactly; uint64 becomes float64 as numpy's
    unchecked cast makes it; any other type (text, a dictionary, booleans) is parsed (`_integer_values`)."""
    kind = chunk.type
    if pa.types.is_null(kind):
        return None, ""
    if kind in _WIDENED:
        chunk = chunk.cast(_WIDENED[kind])
    elif kind == pa.uint64():
        chunk = chunk.cast(pa.float64(), safe=False)
    elif kind not in _KINDS:
        chunk = pa.array(_integer_values(chunk), type=pa.float64())
    return chunk, _KINDS[chunk.type]


@functools.lru_cache(maxsize=64)
def _utf8_values(values: tuple[str, ...]) -> pa.Array:
    """A domain's values as one binary array (built once per domain, not per batch)."""
    return pa.array([v.encode("utf-8") for v in values], type=pa.large_binary())


def _as_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            return repr(value)
        return str(int(value))
    return str(value)


def _parse_integer(value: object) -> float:
    """An integer from a string/number, or NaN when it is not one (kept as data, not an error)."""
    if value is None:
        return math.nan
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) and number == int(number) else math.nan


def _integer_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """float64 values of an integer column; NaN for nulls and non-integers."""
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        # unchecked cast: an integer beyond 2**53 becomes a float beyond every domain bound (|bounds| <= 2**53
        # in the spec), hence invalid by policy; a checked cast would abort the run on one record
        values = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        values = np.where(np.isfinite(values) & (values == np.floor(values)), values, np.nan)
        return values
    if pa.types.is_null(column.type):
        return np.full(len(column), np.nan)
    encoded = dictionary_encoded(column)
    parsed = np.array([_parse_integer(v) for v in dictionary_values(encoded.dictionary)] + [math.nan])
    indices = encoded.indices.fill_null(len(encoded.dictionary))
    return parsed[indices.to_numpy(zero_copy_only=False)]


@dataclass(frozen=True)
class ColumnEncoder:
    """Encodes one column of a batch to cell codes of its domain (INVALID for policy `drop`)."""

    domain: Domain

    @property
    def source(self) -> str:
        """The input column this encoder reads."""
        return self.domain.source if isinstance(self.domain, MeasureDomain) else self.domain.name

    def encode(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Each value's code, in `code_dtype(domain.size)`: an invalid value's is INVALID (policy `drop`), the
        `other` cell's (policy `other`) or a measure's invalid code."""
        domain = self.domain
        dtype = code_dtype(domain.size)
        if isinstance(domain, MeasureDomain):  # value - lower after clamping to [lower, upper]
            return _kernel_codes(column, domain.lower, domain.upper, CLAMP, None, domain.invalid_code, dtype)
        invalid = domain.size - 1 if domain.policy == "other" else INVALID
        if isinstance(domain, IntegerDomain):
            mode, table = _integer_rule(domain, len(column))
            return _kernel_codes(column, domain.minimum, domain.maximum, mode, table, invalid, dtype)
        return _lookup_codes(column, self._values(), invalid, dtype)

    def _values(self) -> tuple[str, ...]:
        """The domain's values in code order (a categorical's values, a geography's leaves)."""
        domain = self.domain
        if isinstance(domain, CategoricalDomain):
            return domain.values
        assert isinstance(domain, GeographyDomain)
        return tuple(domain.leaves)


def _integer_rule(domain: IntegerDomain, rows: int) -> tuple[int, np.ndarray | None]:
    """How an integer column's values become codes: value - minimum without bins; with bins, each value's bin
    read from a table over the range when the batch holds more values than the range (at most LOOKUP_VALUES),
    else searched among the edges. The same codes either way."""
    if not domain.edges:
        return IDENTITY, None
    if domain.maximum - domain.minimum < min(rows, LOOKUP_VALUES):
        return LOOKUP, _bin_lookup(domain.edges, domain.minimum, domain.maximum)
    return EDGES, np.asarray(domain.edges, dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _bin_lookup(edges: tuple[int, ...], minimum: int, maximum: int) -> np.ndarray:
    """Each value's bin over [minimum, maximum] (int32; -1 below the first edge), made once per domain."""
    span = np.arange(minimum, maximum + 1, dtype=np.int64)
    lookup = (np.searchsorted(np.asarray(edges, dtype=np.int64), span, side="right") - 1).astype(np.int32)
    lookup.flags.writeable = False  # shared by every batch
    return lookup


def encode_batch(batch: pa.RecordBatch | pa.Table, encoders: dict[str, ColumnEncoder]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Encode every spec column of a batch. Returns (codes per column, mask of rows kept).

    A row is dropped when any column with policy `drop` holds an invalid value.
    """
    codes: dict[str, np.ndarray] = {}
    keep = np.ones(batch.num_rows, dtype=bool)
    for name, encoder in encoders.items():
        column_codes = encoder.encode(batch.column(encoder.source))
        keep &= column_codes != INVALID
        codes[name] = column_codes
    return codes, keep


UNIT = "__unit__"
"""Name of the privacy-unit column in an encoded table."""
ROWS = "__rows__"
"""A placeholder column (zeros) of an encoded table with no encoded column, so that it keeps its row count (an
Arrow table without columns has none): a release whose tables read no column still counts every record."""


def code_dtype(domain_size: int) -> type:
    """The smallest signed integer type holding codes 0..domain_size-1 (less to spill and shuffle)."""
    for dtype in (np.int8, np.int16, np.int32):
        if domain_size <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def encoded_table(batch: pa.RecordBatch | pa.Table, encoders: dict[str, ColumnEncoder],
                  unit: str | None) -> pa.Table:
    """A batch as an encoded table: codes per spec column in `code_dtype` (+ the unit as UNIT), rows dropped
    by policy and rows with a null unit removed (a record without a unit cannot be bounded)."""
    codes, keep = encode_batch(batch, encoders)
    if unit:
        keep &= pc.is_valid(batch.column(unit)).to_numpy(zero_copy_only=False)
    every = bool(keep.all())  # usually: no filtering copy
    mask = pa.array(keep)
    data = {c: _kept(pa.array(codes[c].astype(code_dtype(encoders[c].domain.size), copy=False)), mask, every)
            for c in encoders}
    if not encoders:
        data[ROWS] = pa.array(np.zeros(int(keep.sum()), dtype=np.int8))
    if unit:
        data[UNIT] = canonical_units(_kept(batch.column(unit), mask, every))
    return pa.table(data)


def _kept(column: pa.Array | pa.ChunkedArray, mask: pa.Array, every: bool) -> pa.Array | pa.ChunkedArray:
    """The column's values where `mask` holds (`every`: it holds everywhere, the column itself)."""
    return column if every else column.filter(mask)


def canonical_units(units: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A unit column in one type per kind of value, however each file stores it: a dictionary's values, text and
    binary as large_binary (the bytes `bound.unit_fingerprints` hashes, never decoded), integers as int64 (uint64
    for a uint64 column only: every narrower integer fits int64, with the same value bits). Grouping, fingerprints
    and shards are those of the values, so records of one unit stored as a dictionary in one file and as text in
    another, or as int32 in one and uint32 in another, are spilled, shuffled and bounded together
    (`source.unit_kind_problems` refuses files whose units no one type holds)."""
    if pa.types.is_dictionary(units.type):
        units = units.cast(units.type.value_type)
    kind = canonical_unit_type(units.type)
    return units if kind is None else units.cast(kind)


def canonical_unit_type(kind: pa.DataType) -> pa.DataType | None:
    """The type `canonical_units` reads a unit column of `kind` as (a dictionary's: its values'): large_binary for
    text and binary, uint64 for uint64, int64 for every other integer; None for any other type (kept as it is)."""
    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    if is_text(value) or pa.types.is_binary(value) or pa.types.is_large_binary(value):
        return pa.large_binary()
    if pa.types.is_integer(value):
        return pa.uint64() if value == pa.uint64() else pa.int64()
    return None

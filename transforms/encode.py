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


def _lookup_codes(column: pa.Array | pa.ChunkedArray, values: tuple[str, ...]) -> np.ndarray:
    """Codes (positions in `values`) of a column via its dictionary; INVALID for misses and nulls. A text
    dictionary is matched as bytes against the values' UTF-8 in one vectorised lookup (text that is not valid
    UTF-8 equals no value); any other dictionary value by its text form (`_as_text`)."""
    encoded = dictionary_encoded(column)
    if is_text(encoded.dictionary.type):
        found = pc.index_in(text_as_bytes(encoded.dictionary), value_set=_utf8_values(values))
        lut = np.append(found.fill_null(INVALID).to_numpy(zero_copy_only=False).astype(np.int64), INVALID)
    else:
        table = {v: i for i, v in enumerate(values)}
        lut = np.array([table.get(_as_text(v), INVALID) for v in dictionary_values(encoded.dictionary)] + [INVALID],
                       dtype=np.int64)
    indices = encoded.indices.fill_null(len(encoded.dictionary))
    return lut[indices.to_numpy(zero_copy_only=False)]


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
        domain = self.domain
        if isinstance(domain, MeasureDomain):
            return self._encode_measure(_integer_values(column), domain)
        if isinstance(domain, IntegerDomain):
            codes = self._encode_integer(_integer_values(column), domain)
        else:
            codes = _lookup_codes(column, self._values())
        if domain.policy == "other":
            other = domain.size - 1
            codes = np.where(codes == INVALID, other, codes)
        return codes

    def _values(self) -> tuple[str, ...]:
        """The domain's values in code order (a categorical's values, a geography's leaves)."""
        domain = self.domain
        if isinstance(domain, CategoricalDomain):
            return domain.values
        assert isinstance(domain, GeographyDomain)
        return tuple(domain.leaves)

    @staticmethod
    def _encode_measure(values: np.ndarray, domain: MeasureDomain) -> np.ndarray:
        """value - lower after clamping to [lower, upper]; invalid_code for null/NaN/non-integers (kept rows)."""
        valid = np.isfinite(values)
        clamped = np.clip(np.where(valid, values, domain.lower), domain.lower, domain.upper)
        return np.where(valid, clamped.astype(np.int64) - domain.lower, domain.invalid_code)

    @staticmethod
    def _encode_integer(values: np.ndarray, domain: IntegerDomain) -> np.ndarray:
        valid = np.isfinite(values) & (values >= domain.minimum) & (values <= domain.maximum)
        safe = np.where(valid, values, domain.minimum).astype(np.int64)
        if domain.edges and domain.maximum - domain.minimum < min(values.size, LOOKUP_VALUES):  # bins from a table
            span = np.arange(domain.minimum, domain.maximum + 1, dtype=np.int64)
            codes = (np.searchsorted(np.asarray(domain.edges), span, side="right") - 1)[safe - domain.minimum]
        elif domain.edges:
            codes = np.searchsorted(np.asarray(domain.edges), safe, side="right") - 1
        else:
            codes = safe - domain.minimum
        return np.where(valid, codes, INVALID)


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
    mask = pa.array(keep)
    data = {c: pa.array(codes[c].astype(code_dtype(encoders[c].domain.size))).filter(mask) for c in encoders}
    if not encoders:
        data[ROWS] = pa.array(np.zeros(int(keep.sum()), dtype=np.int8))
    if unit:
        data[UNIT] = canonical_units(batch.column(unit).filter(mask))
    return pa.table(data)


def canonical_units(units: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A unit column in one type per kind of value, however each file stores it: a dictionary's values, text and
    binary as large_binary (the bytes `bound.unit_fingerprints` hashes, never decoded), integers as int64 (uint64 when
    unsigned). Grouping, fingerprints and shards are those of the values, so records of one unit stored as a
    dictionary in one file and as text in another are spilled, shuffled and bounded together."""
    if pa.types.is_dictionary(units.type):
        units = units.cast(units.type.value_type)
    if is_text(units.type) or pa.types.is_binary(units.type):
        return units.cast(pa.large_binary())
    if pa.types.is_integer(units.type):
        return units.cast(pa.uint64() if pa.types.is_unsigned_integer(units.type) else pa.int64())
    return units

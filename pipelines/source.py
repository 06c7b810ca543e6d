"""Opening the confidential input: Parquet or CSV, a file or a directory, read in batches.

Only public properties abort a run here: a missing file, a missing column, a column whose
type cannot hold the spec's domain. Malformed CSV rows are skipped by policy (never an
error that depends on data content), and CSV columns are read as text so that no value
can make type inference fail.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from dprelease.accounting.errors import InputSchemaError, SpecError

from .plan import Plan
from .spec import GeographyColumn

BATCH_ROWS = 1 << 20
CSV_BLOCK_BYTES = 32 << 20


def _skip_malformed_row(row) -> str:
    return "skip"


CSV_PARSE_OPTIONS = pacsv.ParseOptions(invalid_row_handler=_skip_malformed_row)


def csv_convert_options(columns: list[str], include: bool) -> pacsv.ConvertOptions:
    """CSV columns as text; an empty field is null (as Spark reads it), any other text is a value."""
    return pacsv.ConvertOptions(column_types={c: pa.string() for c in columns}, null_values=[""],
                                strings_can_be_null=True, include_columns=columns if include else None)


def read_batches(path: str, fmt: str, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Record batches of `columns` of one Parquet or CSV file. CSV values are read as text and
    malformed rows skipped (by policy, never an error)."""
    if fmt == "parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=columns)
        return
    reader = pacsv.open_csv(
        path, read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
        parse_options=CSV_PARSE_OPTIONS,
        convert_options=csv_convert_options(columns, include=True),
    )
    yield from reader


@dataclass
class InputSource:
    """The input dataset restricted to the columns the plan needs."""

    dataset: ds.Dataset
    columns: list[str]
    unit_column: str | None
    format: str

    def files(self) -> list[str]:
        return list(self.dataset.files)

    def batches(self, path: str) -> Iterator[pa.RecordBatch]:
        """Record batches of one input file, streamed: memory holds one row group / CSV block at a time."""
        return read_batches(path, self.format, self.columns)

    def estimated_rows(self) -> int:
        """Rows (Parquet metadata) or bytes / 40 (CSV): sizing of internal spill partitions only."""
        if self.format == "parquet":
            return int(self.dataset.count_rows())
        return sum(Path(f).stat().st_size for f in self.files()) // 40


def _format_of(path: Path, declared: str | None) -> str:
    if declared:
        return declared
    if path.is_dir():
        return "csv" if any(path.glob("*.csv")) and not any(path.glob("*.parquet")) else "parquet"
    return "csv" if path.suffix.lower() in (".csv", ".txt") else "parquet"


def open_input(plan: Plan, base_dir: Path, override: str | None = None) -> InputSource:
    """Open the spec's input (or `override`) and check its schema against the plan."""
    spec = plan.spec
    path = Path(override) if override else (base_dir / spec.input.path)
    if not path.exists():
        raise SpecError(f"input.path = {str(path)!r}: no such file or directory")
    fmt = _format_of(path, spec.input.format)
    columns = plan.used_columns() + ([spec.privacy_unit] if spec.privacy_unit else [])
    if fmt == "csv":
        file_format = ds.CsvFileFormat(
            parse_options=CSV_PARSE_OPTIONS,
            convert_options=csv_convert_options(columns, include=False),
        )
    else:
        file_format = ds.ParquetFileFormat()
    try:
        dataset = ds.dataset(str(path), format=file_format)
    except (pa.ArrowInvalid, OSError) as error:
        raise SpecError(f"input.path = {str(path)!r}: cannot be opened as {fmt} ({type(error).__name__})") from None
    if not dataset.files:
        raise SpecError(f"input.path = {str(path)!r}: contains no {fmt} files")
    schema = dataset.schema
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise InputSchemaError(
            f"input {path}: missing column(s) {missing}; the file has {schema.names}"
        )
    problems = []
    for name, column in spec.columns.items():
        if name in columns and isinstance(column, GeographyColumn):
            kind = schema.field(name).type
            value_type = kind.value_type if pa.types.is_dictionary(kind) else kind
            if not (pa.types.is_string(value_type) or pa.types.is_large_string(value_type)):
                problems.append(
                    f"columns.{name}: input column type is {kind}; geography codes must be strings "
                    "(numbers lose leading zeros)"
                )
    if problems:
        raise InputSchemaError(problems)
    return InputSource(dataset, columns, spec.privacy_unit, fmt)

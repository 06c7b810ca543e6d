"""Opening the confidential input: Parquet or CSV, a file or a directory, read in batches.

Only public properties abort a run here: a missing file, a file that is not data, a missing column,
a column whose type cannot hold the spec's domain, checked for EVERY file of an input directory
before any budget is reserved. Messages name the file and the column, never a value. Malformed CSV
rows are skipped by policy (never an error that depends on data content), CSV columns are read as
text, without UTF-8 validation (invalid bytes are an invalid value, handled by the column's policy),
so no value can make reading or type inference fail.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dprelease.accounting.errors import DPReleaseError, InputSchemaError, SpecError
from dprelease.transforms.encode import is_text

from .plan import Plan
from .storage import Store, is_uri, list_files, local_path, open_store, stamps

LOG = logging.getLogger("dprelease")
BATCH_ROWS = 1 << 20
CSV_BLOCK_BYTES = 32 << 20


def _skip_malformed_row(row) -> str:
    return "skip"


CSV_PARSE_OPTIONS = pacsv.ParseOptions(invalid_row_handler=_skip_malformed_row)


def csv_convert_options(columns: list[str], include: bool) -> pacsv.ConvertOptions:
    """CSV columns as text; an empty field is null (as Spark reads it), any other text is a value."""
    return pacsv.ConvertOptions(column_types={c: pa.string() for c in columns}, null_values=[""],
                                strings_can_be_null=True, check_utf8=False,
                                include_columns=columns if include else None)


def read_batches(path: str, fmt: str, columns: list[str], filesystem=None) -> Iterator[pa.RecordBatch]:
    """Record batches of `columns` of one Parquet or CSV file (a local path, or a path of `filesystem`). CSV
    values are read as text and malformed rows skipped (by policy, never an error)."""
    if fmt == "parquet":
        handle = filesystem.open_input_file(path) if filesystem else path
        yield from pq.ParquetFile(handle).iter_batches(batch_size=BATCH_ROWS, columns=columns)
        return
    reader = pacsv.open_csv(
        filesystem.open_input_stream(path) if filesystem else path,
        read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
        parse_options=CSV_PARSE_OPTIONS,
        convert_options=csv_convert_options(columns, include=True),
    )
    yield from reader


FINGERPRINT_BLOCK = 8 << 20


def _file_chunks(paths: list[str], store: Store | None = None) -> Iterator[bytes]:
    """Every file's length and bytes, in order, read in full (through its store for a URI). A store's checksum
    cannot stand in for the bytes: S3's ETag is an MD5 (of the bytes, or of each part's), and MD5 collisions
    are cheap, so two inputs differing in a record could share one ETag and so one fingerprint: the same key
    binding, hence the same noise (their difference published exactly) and a free rerun. pyarrow exposes
    no collision-resistant checksum (S3's x-amz-checksum-sha256, GCS's) to use instead. A size and
    modification time would not do either: they bind a key to two contents written within one clock tick."""
    yield len(paths).to_bytes(8, "big")
    for path in paths:
        if store is None:
            with open(path, "rb") as handle:
                yield os.fstat(handle.fileno()).st_size.to_bytes(8, "big")
                yield from iter(lambda: handle.read(FINGERPRINT_BLOCK), b"")
            continue
        yield from _object_chunks(store, path)


def _object_chunks(store: Store, path: str) -> Iterator[bytes]:
    """An object's length and bytes, read through its store."""
    located = store.path(path)
    info = store.filesystem.get_file_info(located)
    if info.type != pafs.FileType.File:
        raise DPReleaseError(f"input file {path}: disappeared while the run was starting; nothing was charged")
    yield info.size.to_bytes(8, "big")
    read = 0
    with store.filesystem.open_input_stream(located) as handle:
        for block in iter(lambda: handle.read(FINGERPRINT_BLOCK), b""):
            read += len(block)
            yield block
    if read != info.size:
        raise DPReleaseError(f"input file {path}: changed while it was read; nothing was charged")


@dataclass
class InputSource:
    """The input dataset restricted to the columns the plan needs."""

    dataset: ds.Dataset
    columns: list[str]
    unit_column: str | None
    format: str
    file_schemas: dict[str, pa.Schema]
    """Each file's schema, read (and checked) once by `open_input`."""
    store: Store | None = None
    """Where the files are when the input is a URI (`files()` are then URIs); None: local files."""
    location: str | None = None
    """The input's URI as given, connection options included (workers reopen the store from it)."""

    def files(self) -> list[str]:
        files = list(self.dataset.files)
        return [self.store.uri(f) for f in files] if self.store else files

    def batches(self, path: str) -> Iterator[pa.RecordBatch]:
        """Record batches of one input file, streamed: memory holds one row group / CSV block at a time."""
        if self.store:
            return read_batches(self.store.path(path), self.format, self.columns, self.store.filesystem)
        return read_batches(path, self.format, self.columns)

    def fingerprint(self, key) -> str:
        """A keyed fingerprint of the input's bytes (every file, in order, with its length): binds a
        key to this input in the ledger and in the noise. Internal: never published or logged."""
        return key.fingerprint(_file_chunks(sorted(self.files()), self.store))

    def stamps(self) -> list:
        """(file, size, modification time) of every input file: equal before the fingerprint and after the engine's
        read, or the run aborts before anything is charged or published (`run.check_input_unchanged`)."""
        if self.store:
            return stamps(self.store, self.files())
        found = []
        for path in self.files():
            try:
                status = os.stat(path)
                found.append((path, status.st_size, status.st_mtime_ns))
            except OSError:
                found.append((path, None, None))
        return found

    def estimated_rows(self) -> int:
        """Rows (Parquet metadata) or bytes / 40 (CSV): sizing of internal spill partitions only."""
        if self.format == "parquet":
            return int(self.dataset.count_rows())
        if self.store:
            return sum(self.store.filesystem.get_file_info(f).size for f in self.dataset.files) // 40
        return sum(Path(f).stat().st_size for f in self.files()) // 40


MEMORY_INPUT = "<in-memory table>"
"""The one "file" of an in-memory input (`MemorySource`), as messages and progress name it."""


@dataclass
class MemorySource(InputSource):
    """An in-memory table as the input (the Python API's DataFrames, on the embedded engine), never written to
    disk. `open_memory_input` serializes the columns the plan reads once, as an Arrow IPC stream into a buffer
    this process owns; the fingerprint is of those bytes and the engine reads the table they hold. So what is
    read is exactly what was fingerprinted, whatever happens meanwhile to the caller's frame (pandas and
    memory-mapped Arrow tables share their memory), and the same bytes are the same data: a key is never bound
    to two inputs. The same data chunked otherwise is a new binding (costs budget, never shares noise)."""

    table: pa.Table | None = None
    serialized: pa.Buffer | None = None

    def files(self) -> list[str]:
        return [MEMORY_INPUT]

    def batches(self, path: str) -> Iterator[pa.RecordBatch]:
        return iter(self.table.to_batches(max_chunksize=BATCH_ROWS))

    def fingerprint(self, key) -> str:
        return key.fingerprint(iter((b"\x00memory:arrow-ipc-stream", memoryview(self.serialized))))

    def stamps(self) -> list:
        return []  # the serialized buffer is private to this process and never written to

    def estimated_rows(self) -> int:
        return self.table.num_rows


def serialized_copy(table: pa.Table) -> tuple[pa.Buffer, pa.Table]:
    """The table as an Arrow IPC stream in a new buffer, and the table read back from it (zero-copy views of
    that buffer). Schema metadata (pandas' versions and column list) is dropped first: it is not data."""
    table = table.replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=BATCH_ROWS)
    buffer = sink.getvalue()
    return buffer, pa.ipc.open_stream(buffer).read_all()


def open_memory_input(plan: Plan, table: pa.Table) -> MemorySource:
    """An in-memory table as the input, checked like a file (exit 2 naming the column, never a value); only
    the columns the plan reads are kept, copied once into a buffer of this process (`MemorySource`)."""
    spec = plan.spec
    columns = plan.input_columns()
    problems = schema_problems(MEMORY_INPUT, table.schema, plan)
    if problems:
        raise InputSchemaError(problems)
    serialized, copy = serialized_copy(table.select(columns))
    return MemorySource(ds.dataset(copy), columns, spec.privacy_unit, "parquet", {MEMORY_INPUT: copy.schema},
                        table=copy, serialized=serialized)


MARKER_FILES = frozenset({"_SUCCESS", "_metadata", "_common_metadata"})
"""Files that writers (Spark, Hadoop, Parquet tools) leave beside data and that hold no records; with `.crc`
checksum files, the only names an input directory may hold that are not read (and each one is named)."""


def is_marker(name: str) -> bool:
    return name in MARKER_FILES or name.endswith(".crc")


@dataclass(frozen=True)
class InputFiles:
    """The files of an input: every data file exactly once (sorted), and the marker files left out."""

    data: list[str]
    skipped: list[str]


def discover_files(path: Path) -> InputFiles:
    """Every file of an input path, each read exactly once. A directory is walked following links, but a
    link that leads back into a directory being walked (a loop) or to a directory or file already
    reached another way (an alias) is refused (SpecError, exit 2, naming the path): reading it would
    count the same records twice. Names starting with '_' or '.' are data like any other, except the
    known marker files (MARKER_FILES, *.crc), which are skipped and listed."""
    if not path.is_dir():
        return InputFiles([str(path)], [])
    data: list[str] = []
    skipped: list[str] = []
    seen_files: dict[str, str] = {}
    seen_dirs: dict[str, str] = {os.path.realpath(path): str(path)}

    def walk(directory: Path, ancestors: tuple[str, ...]) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            real = os.path.realpath(entry.path)
            if entry.is_dir(follow_symlinks=True):
                if real in ancestors:
                    raise SpecError(f"input.path: {entry.path} leads back to {real}, a directory that contains it "
                                    "(a symbolic link loop); every input file must be read once")
                if real in seen_dirs:
                    raise SpecError(f"input.path: {entry.path} is the directory {seen_dirs[real]} again (a link "
                                    "alias); every input file must be read once: remove one of them")
                seen_dirs[real] = entry.path
                walk(Path(entry.path), ancestors + (real,))
            elif entry.is_file(follow_symlinks=True):
                if is_marker(entry.name):
                    skipped.append(entry.path)
                    continue
                if real in seen_files:
                    raise SpecError(f"input.path: {entry.path} is the file {seen_files[real]} again (a link "
                                    "alias); every input file must be read once: remove one of them")
                seen_files[real] = entry.path
                data.append(entry.path)
            else:
                raise SpecError(f"input.path: {entry.path} is neither a regular file nor a directory (a dangling "
                                "link, a FIFO or a device)")

    walk(path, (os.path.realpath(path),))
    return InputFiles(data, skipped)


def _format_of(files: list[str], declared: str | None) -> str:
    """The declared format, else CSV when every file ends in .csv or .txt, else Parquet."""
    if declared:
        return declared
    text = [f for f in files if Path(f).suffix.lower() in (".csv", ".txt")]
    return "csv" if files and len(text) == len(files) else "parquet"


def value_type(kind: pa.DataType) -> pa.DataType:
    """The type of a column's values: a dictionary's value type, any other type itself."""
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def _allowed(kind: pa.DataType, domain_type: str) -> bool:
    """Whether an input column type can hold values of a spec column (or of the unit, 'unit')."""
    value = value_type(kind)
    if pa.types.is_null(value):
        return True  # every value null: invalid values, handled by the column's policy
    if domain_type == "geography":
        return is_text(value)
    scalar = is_text(value) or pa.types.is_integer(value)
    if domain_type == "unit":
        return scalar or pa.types.is_binary(value) or pa.types.is_large_binary(value)
    return scalar or pa.types.is_floating(value)


ALLOWED_TYPES = {
    "geography": "string (codes keep their leading zeros)",
    "categorical": "string, integer or floating point",
    "integer": "integer, floating point or string",
    "unit": "string, binary or integer",
}


def _file_schema(path: str, fmt: str, columns: list[str], filesystem=None) -> pa.Schema:
    """The schema of one input file (Parquet footer, or the CSV header with every column as text)."""
    if fmt == "parquet":
        return pq.read_schema(path, filesystem=filesystem)
    source = filesystem.open_input_stream(path) if filesystem else path
    with pacsv.open_csv(source, read_options=pacsv.ReadOptions(block_size=1 << 16), parse_options=CSV_PARSE_OPTIONS,
                        convert_options=csv_convert_options(columns, include=False)) as reader:
        return reader.schema


def schema_problems(path: str, schema: pa.Schema, plan: Plan) -> list[str]:
    """Public problems of one file's schema: missing columns and column types that cannot hold the domain."""
    spec = plan.spec
    wanted = {name: spec.columns[name].type for name in plan.used_columns()}
    if spec.privacy_unit:
        wanted[spec.privacy_unit] = "unit"
    missing = [c for c in wanted if c not in schema.names]
    problems = [f"input file {path}: missing column(s) {missing}; the file has {schema.names}"] if missing else []
    for name, domain_type in wanted.items():
        if name in schema.names and not _allowed(schema.field(name).type, domain_type):
            field = f"privacy_unit {name!r}" if domain_type == "unit" else f"columns.{name}"
            problems.append(f"input file {path}: {field}: input column type is {schema.field(name).type}; "
                            f"allowed: {ALLOWED_TYPES[domain_type]}")
        elif name in schema.names and domain_type == "categorical":
            problems += _unmatchable_values(path, name, schema.field(name).type, spec.columns[name].values)
    return problems


CANONICAL_INTEGER = re.compile(r"^-?(0|[1-9][0-9]*)$")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _can_match(value, integer_column: bool) -> bool:
    """Whether a spec value can equal the text of some value of a numeric column (integers are read as their
    canonical text: 1, never 01 or 1.0)."""
    if isinstance(value, int):
        return True
    return bool(CANONICAL_INTEGER.match(str(value))) if integer_column else _is_number(str(value))


def _unmatchable_values(path: str, name: str, kind: pa.DataType, values: list) -> list[str]:
    """A numeric input column under a categorical whose values are all text that is no number: no record can
    match any value (every one would fall in `(other)`), decided from the schema and the spec alone (public)."""
    value = value_type(kind)
    if not (pa.types.is_integer(value) or pa.types.is_floating(value)):
        return []
    if any(_can_match(v, pa.types.is_integer(value)) for v in values):
        return []
    shown = [str(v) for v in values[:5]] + (["..."] if len(values) > 5 else [])
    return [f"input file {path}: columns.{name}: input column type is {kind}, but none of the spec's values "
            f"{shown} is a number as the column writes it, so no record could match one (every record would be "
            "(other)); write the values as the data codes them (for example [0, 1]) or recode the column"]


def check_every_file(files: list[str], fmt: str, plan: Plan, columns: list[str],
                     store: Store | None = None) -> dict[str, pa.Schema]:
    """Schema-level checks of every file of the input (not only the first, which is all a dataset
    infers from): raises InputSchemaError (exit 2) naming each file and column, never a value.
    Returns each file's schema (keyed by its URI when the input is in a store)."""
    problems = []
    schemas = {}
    for located in files:
        path = store.uri(located) if store else located
        try:
            schemas[path] = _file_schema(located, fmt, columns, store.filesystem if store else None)
        except (pa.ArrowException, OSError, ValueError) as error:
            problems.append(f"input file {path}: cannot be read as {fmt} ({type(error).__name__})")
            continue
        problems += schema_problems(path, schemas[path], plan)
    if problems:
        raise InputSchemaError(problems)
    return schemas


def open_input(plan: Plan, base_dir: Path, override: str | None = None) -> InputSource:
    """Open the spec's input (or `override`) and check the schema of every file against the plan."""
    spec = plan.spec
    text = local_path(override or spec.input.path)
    store = None
    if is_uri(text):
        store, root = open_store(text, "input.path")
        path = text
        found = _store_files(store, root)
    else:
        path = Path(text) if override else base_dir / text  # --input is relative to the working directory
        if not path.exists():
            raise SpecError(f"input.path = {str(path)!r}: no such file or directory")
        found = discover_files(path)
    if found.skipped:
        LOG.warning("input: skipped %d marker file(s) that hold no records: %s", len(found.skipped),
                    ", ".join(found.skipped[:10]) + (" ..." if len(found.skipped) > 10 else ""))
    fmt = _format_of(found.data, spec.input.format)
    columns = plan.input_columns()
    if fmt == "csv":
        file_format = ds.CsvFileFormat(
            parse_options=CSV_PARSE_OPTIONS,
            convert_options=csv_convert_options(columns, include=False),
        )
    else:
        file_format = ds.ParquetFileFormat()
    if not found.data:
        raise SpecError(f"input.path = {str(path)!r}: contains no {fmt} files")
    schemas = check_every_file(found.data, fmt, plan, columns, store)  # each file named in its own problems
    try:
        dataset = ds.dataset(found.data, format=file_format, filesystem=store.filesystem if store else None)
    except (pa.ArrowException, OSError) as error:
        raise InputSchemaError(f"input.path = {str(path)!r}: cannot be opened as {fmt} ({type(error).__name__})") from None
    return InputSource(dataset, columns, spec.privacy_unit, fmt, schemas, store, text if store else None)


def _store_files(store: Store, root: str) -> InputFiles:
    """The files below a URI, markers skipped by name as for local directories (`discover_files`)."""
    data, skipped = [], []
    for path in list_files(store, root, "input.path"):
        (skipped if is_marker(path.rsplit("/", 1)[-1]) else data).append(path)
    return InputFiles(data, [store.uri(p) for p in skipped])

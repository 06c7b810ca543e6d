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
import pyarrow.parquet as pq

from dprelease.accounting.errors import DPReleaseError, InputSchemaError, SpecError
from dprelease.accounting.redact import shown
from dprelease.transforms.encode import canonical_unit_type, is_text

from .plan import Plan
from .storage import (FileDigest, Store, fingerprint_files, is_uri, list_files, local_path, open_store,
                      verified_copy)

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


def read_batches(source, fmt: str, columns: list[str], row_groups: tuple[int, int] | None = None
                 ) -> Iterator[pa.RecordBatch]:
    """Record batches of `columns` of one Parquet or CSV file (`source`: a path, or an open pyarrow file; for
    Parquet, `row_groups` (first, stop) restricts the read to those row groups). CSV values are read as text and
    malformed rows skipped (by policy, never an error)."""
    if fmt == "parquet":
        parquet = pq.ParquetFile(source)
        stored = dictionary_columns(parquet, columns)
        if stored:  # the footer already read is reused
            parquet = pq.ParquetFile(source, metadata=parquet.metadata, read_dictionary=stored)
        groups = None if row_groups is None else list(range(*row_groups))
        if groups == []:
            return
        yield from parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns, row_groups=groups)
        return
    reader = pacsv.open_csv(
        source,
        read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
        parse_options=CSV_PARSE_OPTIONS,
        convert_options=csv_convert_options(columns, include=True),
    )
    yield from reader


def dictionary_columns(parquet: pq.ParquetFile, columns: list[str]) -> list[str]:
    """The columns among `columns` that the file stores dictionary-encoded (its first row group says): read as
    dictionary arrays, a text column is never materialised value by value (encoding then looks up each batch's
    dictionary, as for a file whose Arrow schema says dictionary). Columns stored plain are read as they are
    (building a dictionary for them would hash every value). A public property of the file's layout."""
    metadata = parquet.metadata
    if metadata.num_row_groups == 0:
        return []
    first = metadata.row_group(0)
    encodings = {first.column(i).path_in_schema: first.column(i).encodings for i in range(first.num_columns)}
    return [c for c in columns if any("DICTIONARY" in e for e in encodings.get(c, ()))]


@dataclass(frozen=True)
class ReadTask:
    """One unit of reading work: a file (and for Parquet a range of its row groups). Engines hand these to
    their workers; any split gives the same records."""

    path: str
    row_groups: tuple[int, int] | None = None


@dataclass(frozen=True)
class FileReader:
    """What a worker needs to read input files as the engine counts them (picklable: Spark executors and Beam
    workers get it): the format, the columns, the store's URI (reopened in the worker, credentials from its
    environment) and the digest of every file taken when the key was bound. With digests, every file is parsed
    from a private copy whose bytes are shown to be those (`storage.verified_copy`)."""

    format: str
    columns: tuple[str, ...]
    location: str | None = None
    digests: tuple[tuple[str, FileDigest], ...] | None = None

    def batches(self, task: ReadTask | str) -> Iterator[pa.RecordBatch]:
        """Record batches of one read task (or a whole file named by its path)."""
        task = task if isinstance(task, ReadTask) else ReadTask(task)
        store = open_store(self.location, "input.path")[0] if self.location else None
        located = store.path(task.path) if store else task.path
        filesystem = store.filesystem if store else None
        if self.digests is not None:
            expected = dict(self.digests).get(task.path)
            if expected is None:
                raise DPReleaseError(f"input file {task.path}: not among the files the key was bound to")
            handle = verified_copy(located, filesystem, expected, task.path)
        elif filesystem is not None:
            handle = filesystem.open_input_file(located) if self.format == "parquet" \
                else filesystem.open_input_stream(located)
        else:
            handle = located
        yield from read_batches(handle, self.format, list(self.columns), task.row_groups)


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
    digests: dict[str, FileDigest] | None = None
    """Each file's length and SHA-256, taken with the fingerprint (`fingerprint`): from then on every read of a
    file is of those bytes or fails (`storage.verified_copy`)."""

    workers_can_read = True
    """Whether other processes can read the input (through `reader()`): its files can be reopened anywhere."""

    def files(self) -> list[str]:
        files = list(self.dataset.files)
        return [self.store.uri(f) for f in files] if self.store else files

    def reader(self) -> FileReader:
        """The picklable reader every engine's workers read the input with (verifying digests once taken)."""
        digests = None if self.digests is None else tuple(sorted(self.digests.items()))
        return FileReader(self.format, tuple(self.columns), self.location, digests)

    def batches(self, path: str) -> Iterator[pa.RecordBatch]:
        """Record batches of one input file, from a private copy of the bytes the key is bound to (once the
        fingerprint is taken); memory holds the file's copy and one row group / CSV block of records."""
        return self.reader().batches(path)

    def read_tasks(self, parallelism: int = 1) -> list[ReadTask]:
        """The files as read tasks for `parallelism` workers: a Parquet file with several row groups is split
        into up to `parallelism` ranges of them when there are fewer files than workers (each task verifies
        the whole file's bytes and parses its own row groups). The row groups are counted from the footer of the
        bytes the key is bound to (`FileDigest.row_groups`), never the live file: tasks planned from a file
        rewritten meanwhile would count only part of the bound bytes. Before a fingerprint (validation) and when
        a footer was not read with it, each file is one task."""
        files = self.files()
        if self.format != "parquet" or len(files) >= parallelism or self.digests is None:
            return [ReadTask(f) for f in files]
        per_file = -(-parallelism // max(len(files), 1))
        tasks = []
        for path in files:
            groups = self.digests[path].row_groups
            if not groups:
                tasks.append(ReadTask(path))
                continue
            pieces = max(1, min(per_file, groups))
            bounds = [groups * i // pieces for i in range(pieces + 1)]
            tasks += [ReadTask(path, (lo, hi)) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        return tasks or [ReadTask(f) for f in files]

    def fingerprint(self, key) -> str:
        """A keyed fingerprint of the input's bytes (every file, in order, with its length): binds a key to this
        input in the ledger and in the noise. Takes each file's digest on the same read, after which every read
        of the input is verified against it. Internal: never published or logged."""
        names = sorted(self.files())
        located = [(self.store.path(n) if self.store else n, n) for n in names]
        fingerprint, self.digests = fingerprint_files(located, self.store.filesystem if self.store else None,
                                                      key.derive("dprelease/input-fingerprint"),
                                                      parquet=self.format == "parquet")
        return fingerprint

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

    workers_can_read = False  # the table lives in this process only

    def files(self) -> list[str]:
        return [MEMORY_INPUT]

    def batches(self, path: str) -> Iterator[pa.RecordBatch]:
        return iter(self.table.to_batches(max_chunksize=BATCH_ROWS))  # the private buffer fingerprinted

    def reader(self) -> FileReader:
        raise DPReleaseError("an in-memory table is read by the embedded engine only")

    def fingerprint(self, key) -> str:
        return key.fingerprint(iter((b"\x00memory:arrow-ipc-stream", memoryview(self.serialized))))

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
        if not path.is_file():
            raise SpecError(f"input.path: {shown(path)} is neither a regular file nor a directory (a FIFO, a device "
                            "or a dangling link)")
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
    return bool(CANONICAL_INTEGER.fullmatch(str(value))) if integer_column else _is_number(str(value))


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
    problems += unit_kind_problems(schemas, plan.spec.privacy_unit)
    if problems:
        raise InputSchemaError(problems)
    return schemas


def unit_kind(kind: pa.DataType) -> str:
    """The one type a unit column of `kind` is read as (`encode.canonical_unit_type`), by name: text, uint64, int64,
    or the column's own value type (null)."""
    canonical = canonical_unit_type(kind)
    if canonical is None:
        return str(value_type(kind))
    return "text" if canonical == pa.large_binary() else str(canonical)


def unit_kind_problems(schemas: dict[str, pa.Schema], unit: str | None) -> list[str]:
    """A problem when the files' privacy-unit columns are not all read as one type (text, a signed integer or
    narrower unsigned one, uint64; or of type null: a file without any unit): their records could not be grouped
    together. Public: from the schemas alone."""
    kinds: dict[str, str] = {}
    for path, schema in schemas.items():
        if unit and unit in schema.names:
            kinds.setdefault(unit_kind(schema.field(unit).type), path)
    if len(kinds) < 2:
        return []
    shown_kinds = ", ".join(f"{kind} in {path}" for kind, path in kinds.items())
    return [f"privacy_unit {unit!r}: the input files hold it as different kinds of value ({shown_kinds}); every "
            "file must hold it as text, as integers that fit int64, or as uint64"]


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

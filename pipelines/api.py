"""The Python API: `dprelease.Release` (a spec, its plan and its runs) and `ReleaseResult` (a published release).

The same checks, messages, ledger and exit-code classes as the CLI (every error is a `DPReleaseError`; its
`exit_code` is the CLI's). The ledger is on by default, exactly as in `dprelease run`: pass `ledger=None` to run
without one. Data held in memory (pandas, Polars, a pyarrow Table) is copied once into an Arrow IPC buffer the
run owns and read from there by the embedded engine (`source.MemorySource`: the key is bound to those bytes,
every schema check applies); a pyarrow Dataset, or
a frame on another engine, is written once to a private temporary Parquet file (mode 0700 directory, removed
after the run) and read from there like any input; a Spark DataFrame runs on the spark engine in the caller's
session (never stopped), written by the executors to `spark_staging` first.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from dprelease.accounting.errors import DPReleaseError, PublishError, SpecError
from dprelease.accounting.redact import shown

from . import arguments
from .engines.base import ProgressHook, no_progress
from .housekeeping import input_copy_prefix, leftover_tag, terminate_as_exit, write_failure
from .layout import Layout
from .plan import Plan, build_plan
from .provenance import run_invocation
from .run import RunResult, run_release_spec
from .spec import ReleaseSpec, load_spec, parse_spec
from .storage import as_location

DEFAULT_LEDGER = "default"
"""`ledger=` value meaning the CLI's default: $DPRELEASE_LEDGER, else ledger.sqlite in the user data directory."""
ENGINES = ("embedded", "spark", "beam")


def ledger_location(ledger: object) -> str | Path | None:
    """The ledger a `ledger=` argument names: None (no ledger), the default, a SQLite path or a SQLAlchemy URL."""
    if ledger is None:
        return None
    if isinstance(ledger, str) and ledger == DEFAULT_LEDGER:
        from dprelease.accounting.ledger import default_ledger_location

        return os.environ.get("DPRELEASE_LEDGER") or default_ledger_location()
    if isinstance(ledger, str) and "://" in ledger:
        if "\0" in ledger:
            raise SpecError("ledger: not a URL")
        if not ledger.startswith("sqlite:///"):
            return ledger
        local = Path(ledger.removeprefix("sqlite:///"))
    else:
        local = arguments.path(ledger, "ledger", optional=False)
    from .storage import check_outside_releases

    check_outside_releases(local.expanduser().absolute(), "ledger", local,
                           "a ledger (key ids, input fingerprints, hosts) never goes into a release")
    return ledger if isinstance(ledger, str) and "://" in ledger else local


@contextlib.contextmanager
def public_errors(internal_dir: Path | None = None, stage: str = "run"):
    """Around the work of an entry point: a DPReleaseError passes with its public message and without its cause
    (an engine's error text can quote values); a database error of the ledger becomes one public line; any other
    exception becomes a DPReleaseError naming only its type, its traceback written to a 0600 file in
    `internal_dir` when given. So every exception that leaves the API is a DPReleaseError with its exit code."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except DPReleaseError as error:
        error.__cause__, error.__suppress_context__ = None, True
        raise error
    except SQLAlchemyError as error:
        from dprelease.accounting.ledger import LedgerError

        raise LedgerError(f"ledger: the database failed ({type(error).__name__}); check that it is reachable") \
            from None
    except Exception as error:  # noqa: BLE001 - nothing unvetted reaches the caller
        where = write_failure(internal_dir, stage) if internal_dir else None
        detail = f"details in {shown(where)}" if where else "pass internal_dir= (--internal-dir) to keep the " \
            "details (confidential)"
        raise DPReleaseError(f"{stage} failed ({type(error).__name__}); its message may quote confidential values "
                             f"and is not shown; {detail}") from None


class Release:
    """A release spec, ready to plan and run. Build one with `from_yaml`, `from_dict` or `from_spec`."""

    def __init__(self, spec: ReleaseSpec, base_dir: str | Path = "."):
        """`base_dir`: where the spec's relative paths (input, domain files, output) start."""
        if not isinstance(spec, ReleaseSpec):
            raise SpecError(f"spec: a ReleaseSpec (use Release.from_yaml or Release.from_dict), got "
                            f"{type(spec).__name__}")
        self.spec = spec
        self.base_dir = arguments.path(base_dir, "base_dir", optional=False).resolve()

    @classmethod
    def from_yaml(cls, path: str | Path, base_dir: str | Path | None = None) -> "Release":
        """The spec in a YAML file; its relative paths start from the file's directory (or `base_dir`)."""
        spec, base = load_spec(arguments.path(path, "spec", optional=False))
        return cls(spec, base if base_dir is None else arguments.path(base_dir, "base_dir"))

    def release_location(self) -> str | Path:
        """Where a run publishes this release without `out_dir`: <output.dir>/<release id> (a URI for a store)."""
        root = as_location(self.spec.output.dir, self.base_dir)
        if isinstance(root, Path):
            return root / self.release_id
        prefix, _, query = root.partition("?")
        return f"{prefix.rstrip('/')}/{self.release_id}" + (f"?{query}" if query else "")

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], base_dir: str | Path = ".") -> "Release":
        """A spec as a mapping (what the YAML file would hold), validated like a file (SpecError, exit code 2)."""
        if not isinstance(document, Mapping):
            raise SpecError(f"spec: a mapping of the spec's fields, got {type(document).__name__}")
        return cls(parse_spec(dict(document)), base_dir)

    @classmethod
    def from_spec(cls, spec: ReleaseSpec, base_dir: str | Path = ".") -> "Release":
        return cls(spec, base_dir)

    @property
    def release_id(self) -> str:
        return self.spec.release_id

    def build_plan(self) -> Plan:
        """The plan (reads the domain files, never the data)."""
        return build_plan(self.spec, self.base_dir)

    def with_budget(self, **budget) -> "Release":
        """The same release at another budget, to compare expected errors before spending any (reads no data):
        `release.with_budget(rho="1/4").plan()`. `budget`: fields of the spec's budget (epsilon, rho, delta) to change,
        or a whole new budget (with `definition`), validated like a spec file."""
        document = self.spec.model_dump(mode="json", exclude_unset=True)
        for query in document["queries"]:  # `select: auto` chooses again at the new budget
            if query["name"] in self.spec.auto_selections:
                query["select"] = "auto"
        document["budget"] = dict(budget) if "definition" in budget else {**document["budget"], **budget}
        return Release(parse_spec(document), self.base_dir)

    def plan(self):
        """Per table: cells, sensitivity, budget, mechanism, noise std, 95% margin and the largest GLS std of the
        count tables, as a pandas DataFrame (as `dprelease plan --json`; reads no data). A mean's row has
        `mean_std_at_n`: its standard deviation at n records in a cell is at most that / n."""
        import pandas as pd

        from .plan_table import PLAN_COLUMNS, plan_records
        from .postprocessing import estimate_variances

        plan = self.build_plan()
        records = plan_records(plan, estimate_variances(plan))
        return pd.DataFrame.from_records(records, columns=[*PLAN_COLUMNS, "quantiles", "mean_std_at_n"])

    def validate(self, internal_dir: str | Path, data: str | Path | None = None, *, engine: str | None = None,
                 master: str | None = None):
        """`dprelease validate`: the input (the spec's, or the path `data`) checked against the spec's
        great-expectations suite; no key, budget or noise. Schema failures raise InputSchemaError (exit 2); the
        value-level report (confidential) goes to `internal_dir`, a private directory. Returns a `ValueCheck`:
        the report's path and the failed value checks in public words (columns and checks, never values)."""
        from .run import validate_spec

        internal = arguments.path(internal_dir, "internal_dir", optional=False)
        engine = arguments.choice(engine, "engine", ENGINES)
        data = arguments.location(data, "data")
        with terminate_as_exit(), public_errors(internal, "validate"):
            return validate_spec(self.spec, self.base_dir, internal, input_path=None if data is None else str(data),
                                 engine=engine, master=master)

    def publish(self, data: Any = None, *, ledger: str | Path | None = DEFAULT_LEDGER,
                out_dir: str | Path | None = None, key_file: str | Path | None = None, engine: str | None = None,
                workers: int | None = None, overwrite: bool = False, internal_dir: str | Path | None = None,
                strict: bool = False, sign_key: str | Path | None = None, max_cells: int | None = None,
                layout: Layout | None = None, spark_staging: str | Path | None = None, master: str | None = None,
                runner: str | None = None, pipeline_options: list[str] | None = None,
                progress: ProgressHook = no_progress, entry: str = "python Release.publish") -> RunResult:
        """Run the release and publish it; returns where it was published and its key (`RunResult`), without
        reading it back (`run` also opens it). The options are those of `run`; `master` (spark), `runner` and
        `pipeline_options` (beam) are the CLI's; `entry` names the entry point in the manifest's provenance."""
        options = dict(ledger=ledger_location(ledger), key_file=arguments.path(key_file, "key_file"),
                       engine=arguments.choice(engine, "engine", ENGINES),
                       workers=arguments.count(workers, "workers", 1, 256),
                       overwrite=arguments.flag(overwrite, "overwrite"),
                       internal_dir=arguments.path(internal_dir, "internal_dir"),
                       strict=arguments.flag(strict, "strict"), sign_key=arguments.path(sign_key, "sign_key"),
                       max_cells=arguments.count(max_cells, "max_cells"),
                       layout=_layout(layout), master=arguments.text(master, "master"),
                       runner=arguments.text(runner, "runner"),
                       beam_options=arguments.texts(pipeline_options, "pipeline_options"), progress=progress)
        out = arguments.location(out_dir, "out_dir")
        options["out_dir"] = out if out is not None else as_location(self.spec.output.dir, self.base_dir)
        with terminate_as_exit(), public_errors(options["internal_dir"], "run"), \
                _input_of(data, options["engine"], spark_staging, self.release_id, options["out_dir"],
                          self.spec.engine) as (input_path, session):
            if session is not None:
                options.update(engine="spark", spark_session=session)
            kind = "path"
            if isinstance(input_path, pa.Table):
                options.update(engine="embedded", input_table=input_path)
                input_path, kind = None, "in-memory table"
            elif data is not None and not isinstance(data, (str, Path)):
                kind = "Spark DataFrame" if session is not None else "in-memory table"
            options["invocation"] = run_invocation(
                entry, engine=options["engine"] or self.spec.engine, workers=options["workers"],
                overwrite=options["overwrite"], master=options["master"], runner=options["runner"],
                beam_options_given=options["beam_options"], ledger=options["ledger"], out_dir=out_dir,
                input_path=input_path, input_kind=kind, sign_key=options["sign_key"],
                internal_dir=options["internal_dir"], strict=options["strict"], max_cells=options["max_cells"])
            return run_release_spec(self.spec, self.base_dir, input_path=input_path, **options)

    def run(self, data: Any = None, **options) -> "ReleaseResult":
        """Run the release and publish it; returns the published release (`ReleaseResult`, read back).

        `data`: None (the spec's input.path), a path, a pandas or Polars DataFrame, a pyarrow Table or Dataset,
        or a Spark DataFrame (then the spark engine runs on its session). `ledger`: a SQLite file or SQLAlchemy
        URL, the default ledger (as the CLI), or None for no budget accounting. Every other option is the CLI's
        (`publish` lists them).
        """
        options.setdefault("entry", "python Release.run")
        result = self.publish(data, **options)
        for warning in result.coding_warnings:
            warnings.warn(warning, UserWarning, stacklevel=2)
        try:
            return ReleaseResult.open(result.release_dir, run=result)
        except DPReleaseError as error:  # published and charged: say so, never as a failed run to repeat
            raise PublishError(f"release {self.release_id}: published to {shown(result.release_dir)} and charged, "
                               f"but reading it back failed ({error}); open it later with "
                               "dprelease.ReleaseResult.open(...)") from None


def _layout(layout: object) -> Layout | None:
    if layout is not None and not isinstance(layout, Layout):
        raise SpecError(f"layout: a dprelease.pipelines.layout.Layout, got {type(layout).__name__}")
    return layout


class _input_of:
    """The input path a run reads for `data` (and the Spark session to run on); a private temporary copy of data
    held in memory, removed on exit."""

    def __init__(self, data: Any, engine: str | None, spark_staging: str | Path | None, release_id: str,
                 out_dir: Path, spec_engine: str = "embedded"):
        self.data, self.engine = data, engine
        self.spark_staging = arguments.path(spark_staging, "spark_staging")
        self.spec_engine = spec_engine
        self.release_id, self.out_dir = release_id, out_dir
        self.temporary: Path | None = None

    def __enter__(self) -> tuple[str | None, Any]:
        try:
            return self._stage()
        except BaseException:
            self.__exit__()
            raise

    def _stage(self) -> tuple[str | None, Any]:
        data = self.data
        if data is None or isinstance(data, (str, Path)):
            return (None if data is None else str(arguments.location(data, "data"))), None
        if _is_spark_frame(data):
            if self.engine not in (None, "spark"):
                raise SpecError(f"engine = {self.engine!r}: a Spark DataFrame runs on the spark engine")
            self._check_spark_staging(data.sparkSession)
            target = self._directory(self.spark_staging) / "input"
            data.write.parquet(str(target))
            _remove_markers(target)
            return str(target), data.sparkSession
        table = arrow_of(data)
        if isinstance(table, ds.FileSystemDataset) and isinstance(table.format, ds.CsvFileFormat):
            table = _csv_as_text(table)
        if isinstance(table, pa.Table) and (self.engine or self.spec_engine) == "embedded":
            return table, None  # copied into a private buffer by run (input_table), never written to disk
        if isinstance(table, pa.Table):
            target = self._directory(None) / "input.parquet"
            # a scratch copy read once: uncompressed and without statistics, the cheapest Parquet to write
            pq.write_table(table, target, compression="none", write_statistics=False)
        else:
            target = self._directory(None) / "input"
            ds.write_dataset(table, target, format="parquet")
        return str(target), None

    def _check_spark_staging(self, session) -> None:
        """The executors write the frame under `spark_staging`, which the driver then lists: on a cluster it must
        be storage they share (asked for, never guessed), and never inside the output directory (published)."""
        if self.spark_staging is None:
            if not session.sparkContext.master.startswith("local"):
                raise SpecError(f"spark_staging: needed on a cluster (master {session.sparkContext.master!r}): a "
                                "directory every executor and the driver share, outside the output directory")
            return
        from .housekeeping import remove_stale
        from .storage import check_outside_releases

        staging = Path(self.spark_staging).resolve()
        if isinstance(self.out_dir, Path) and staging.is_relative_to(self.out_dir.resolve()):
            raise SpecError(f"spark_staging = {shown(self.spark_staging)!r}: must not be inside the output directory "
                            f"{shown(self.out_dir)} (the input copy is confidential)")
        check_outside_releases(staging / "copy", "spark_staging", self.spark_staging,
                               "the input copy is confidential")
        remove_stale(staging, input_copy_prefix(self.release_id))  # a copy a killed run left here

    def _directory(self, parent: str | Path | None) -> Path:
        """A private (0700) directory for the copy, named so a later run removes it if this process dies."""
        prefix = input_copy_prefix(self.release_id) + leftover_tag()
        self.temporary = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        return self.temporary

    def __exit__(self, *exc) -> None:
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)


def _remove_markers(directory: Path) -> None:
    """Remove the marker files Spark's writer leaves (_SUCCESS, *.crc) from the run's own copy of a frame, so the
    input reader has none to skip and name (it names markers it finds in a user's input)."""
    from .source import is_marker

    if directory.is_dir():
        for entry in directory.iterdir():
            if is_marker(entry.name) and entry.is_file() and not entry.is_symlink():
                entry.unlink()


def _csv_as_text(dataset: ds.FileSystemDataset) -> ds.FileSystemDataset:
    """A CSV dataset re-read with every column as text, as the input reader reads CSV: a type inferred from some
    rows would make another row's value an error, so whether a run failed would depend on the data."""
    from .source import CSV_PARSE_OPTIONS, csv_convert_options

    text = ds.CsvFileFormat(parse_options=CSV_PARSE_OPTIONS,
                            convert_options=csv_convert_options(dataset.schema.names, include=False))
    return ds.dataset(dataset.files, format=text, filesystem=dataset.filesystem)


def _is_spark_frame(data: Any) -> bool:
    return type(data).__module__.startswith("pyspark.") and hasattr(data, "sparkSession")


def arrow_of(data: Any) -> pa.Table | ds.Dataset:
    """A pyarrow Table (or Dataset, streamed) of an in-memory frame. Whether this succeeds depends on the frame's
    public properties only (its type, column names and dtypes), never on its values: a pandas frame's object and
    categorical columns become text first (`_objects_as_text`), and a column whose dtype Arrow cannot hold is a
    SpecError naming it. The index of a pandas frame is not a column."""
    if isinstance(data, (pa.Table, ds.Dataset)):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    package = type(data).__module__.split(".", 1)[0]  # pandas 3 names its frame's module "pandas"
    kind = f"{type(data).__module__}.{type(data).__name__}"
    if package == "pandas":
        import pandas as pd

        if isinstance(data, pd.DataFrame):
            return _pandas_table(data)
    if package == "polars" and hasattr(data, "to_arrow") and not type(data).__name__.endswith("Series"):
        return data.to_arrow()
    if package in ("pandas", "polars") and type(data).__name__.endswith("Series"):
        raise SpecError(f"data: a {kind}, not a DataFrame; pass series.to_frame() (its name is the column)")
    raise SpecError(f"data: a path, a pandas or Polars DataFrame, a pyarrow Table or Dataset or a Spark DataFrame; "
                    f"got {kind}")


def _pandas_table(frame) -> pa.Table:
    """A pandas DataFrame as Arrow, column by column (see `arrow_of`)."""
    names = [str(name) for name in frame.columns]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated or any(not isinstance(name, str) for name in frame.columns):
        raise SpecError("data: column names must be distinct text; "
                        + (f"repeated: {repeated}" if repeated else f"got {[type(n).__name__ for n in frame.columns]}"))
    columns = {}
    for name in names:
        series = frame[name]
        dtype = series.dtype
        if dtype.kind == "c":
            raise SpecError(f"data: column {name!r} holds complex numbers ({dtype}); no domain holds them")
        if hasattr(series, "sparse") and str(dtype).startswith("Sparse"):
            series = series.sparse.to_dense()
        if str(series.dtype) in ("category", "string", "str") or series.dtype == object:
            series = _as_text(series)
        try:
            columns[name] = pa.Array.from_pandas(series)
        except (pa.ArrowException, TypeError, ValueError):
            raise SpecError(f"data: column {name!r} has dtype {dtype}, which Arrow cannot hold; convert it to "
                            "numbers or text") from None
    return pa.table(columns)


def _as_text(series):
    """A column of mixed or Python values (object, categorical, text) as text: each value as str, missing values
    and text that is not valid Unicode (a lone surrogate, from `surrogateescape` decoding) null, so no value can
    make the conversion fail (or an error quote it); the encoder applies the column's policy to both."""
    import pandas as pd

    return pd.array([_text(v) for v in series.tolist()], dtype="string")


def _text(value) -> str | None:
    if _missing(value):
        return None
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None  # not text Arrow can hold: an invalid value, as null is
    return text


def _missing(value) -> bool:
    import pandas as pd

    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and value != value)


@dataclass
class ReleaseResult:
    """A published release: its directory, manifest and tables (each a pandas DataFrame with its error columns)."""

    directory: Path
    manifest: dict
    key_file: Path | None = None
    key_reused: bool | None = None
    location: str | None = None
    """The release's object-store URI when it was read from one (`directory` is then a temporary copy)."""
    _tables: dict = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, directory: str | Path, run: RunResult | None = None) -> "ReleaseResult":
        """A published release directory (its manifest parsed; tables read when asked for), or an object-store
        URI (downloaded to a private temporary copy, removed with this object; `location` is the URI). A release
        is untrusted: its manifest is a regular file inside it, bounded in size and nesting (as verify reads it),
        and every table is read the same way (`error_columns.open_table_file`)."""
        location = arguments.location(directory, "directory", optional=False)
        if isinstance(location, str):
            return cls._open_remote(location, run)
        with public_errors(stage="opening the release"):
            manifest = read_manifest(location)
        return cls(location, manifest, run.key_file if run else None, run.key_reused if run else None)

    @classmethod
    def _open_remote(cls, uri: str, run: RunResult | None) -> "ReleaseResult":
        from .storage import downloaded

        copy = contextlib.ExitStack()
        try:
            result = cls.open(copy.enter_context(downloaded(uri, "directory")).path, run)
        except BaseException:
            copy.close()
            raise
        result.location = uri
        weakref.finalize(result, copy.close)
        return result

    @property
    def release_id(self) -> str:
        return self.manifest["release_id"]

    @property
    def table_names(self) -> list[str]:
        return [t["name"] for t in self.manifest["tables"]]

    def table(self, name: str):
        """Table `name` as a pandas DataFrame with its error columns: count tables `gls_variance` and `std` (of the
        least-squares estimate); sums `std` and `margin_95` (of the noise); quantiles `rank_margin_95`; means
        `std_approx` (see `error_columns`). Read through the storage layer, bounded by the table's cells; any
        failure is a DPReleaseError."""
        if name not in self._tables:
            with public_errors(stage="reading the table"):
                self._tables[name] = self._read_table(name)
        return self._tables[name]

    @property
    def tables(self) -> dict:
        """Every published table and mean, by name."""
        return {name: self.table(name) for name in self.table_names + self.mean_names}

    def _read_table(self, name: str):
        from .error_columns import with_error_columns

        allowed = self.table_names + self.mean_names
        if name not in allowed:
            raise SpecError(f"table = {name!r}: allowed: {', '.join(allowed)}")
        return with_error_columns(self.directory, self.manifest, name)

    @property
    def debiased_names(self) -> list[str]:
        """The count tables also published debiased (they cross a column collected under randomized response)."""
        local = self.manifest.get("local_randomization")
        tables = local.get("debiased_tables") if isinstance(local, dict) else None
        return [t["table"] for t in tables if isinstance(t, dict) and isinstance(t.get("table"), str)] \
            if isinstance(tables, list) else []

    def debiased(self, name: str):
        """debiased/<name> as a pandas DataFrame: per cell the unbiased estimate of the count of true values,
        its `variance` (central noise, exact, plus `response_variance`, the randomization's, at the estimate
        clipped at 0) and `std`."""
        from .error_columns import read_table

        if name not in self.debiased_names:
            raise SpecError(f"debiased table = {name!r}: allowed: {', '.join(self.debiased_names) or 'none'}")
        frame = read_table(self.directory, self.manifest, name, "debiased").to_pandas()
        frame["std"] = frame["variance"] ** 0.5
        return frame

    @property
    def mean_names(self) -> list[str]:
        """The means (each the ratio of a sum table and a count table of the release)."""
        return [m["table"] for m in self.manifest.get("means") or []]

    @property
    def coding_warnings(self) -> list[str]:
        """Dimensions whose `(other)` cells hold a large share of a published count table (a category spelled
        otherwise than the data codes it): read from the published tables only, so safe to print."""
        from .coding_check import other_shares

        with public_errors(stage="the coding check"):
            return [share.message() for share in other_shares(self.directory, self.manifest)]

    def verify(self, public_key: str | Path | None = None, ledger: str | Path | None = None,
               recompute: bool = False):
        """`dprelease verify` on this release: the report, or VerificationError (exit code 1) naming every problem."""
        from dprelease.accounting.errors import VerificationError

        from .commands import verify

        report = verify(self.directory, public_key, ledger, recompute)
        if not report.ok:
            raise VerificationError(f"{self.directory}: " + "; ".join(report.problems))
        return report


def read_manifest(directory: Path) -> dict:
    """The manifest of a release directory, read as verify reads it (a regular file inside the directory, at most
    64 MiB, strict JSON nested at most a few levels, no huge numbers), with the fields the API reads checked
    for their type. DPReleaseError otherwise."""
    from .storage import UnsafeFile, read_inside, regular_directory
    from .storage.objects import MAX_MANIFEST_BYTES
    from .verify import parse_json_bounded

    where = shown(directory)
    if not regular_directory(directory):
        raise DPReleaseError(f"{where}: not a release directory (missing, or a symbolic link)")
    try:
        manifest = parse_json_bounded(read_inside(directory, "manifest.json", MAX_MANIFEST_BYTES))
    except UnsafeFile as error:
        raise DPReleaseError(f"{where}: not a published release (manifest.json: {error})") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise DPReleaseError(f"{where}: manifest.json is not strict JSON ({type(error).__name__})") from None
    shapes = {"release_id": str, "tables": list, "files": list}
    if not isinstance(manifest, dict) or any(not isinstance(manifest.get(k), t) for k, t in shapes.items()) \
            or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in manifest["tables"]):
        raise DPReleaseError(f"{where}: manifest.json is not a release manifest (run `dprelease verify` on it)")
    return manifest


def randomize_responses(values, domain: list, epsilon, seed: bytes | None = None):
    """Rehearse a collection under k-ary randomized response: each value (one of `domain`, matched as text) is
    reported truthfully with probability e^ε₀/(e^ε₀ + k − 1), else as one of the k − 1 others, uniformly, drawn
    exactly from a keyed AES stream (`seed`: 32 bytes for a reproducible draw; default a fresh random key).
    Returns the reports as text. Real reports are randomized on the respondent's side; this is for tests,
    examples and rehearsals. Never reuse a seed for another column or collection: the same stream over other
    values correlates the reports (for k = 2 they would reveal whether two true values are equal)."""
    from fractions import Fraction

    import numpy as np

    from dprelease.accounting.rationals import parse_rational
    from dprelease.transforms.csprng import CellStream
    from dprelease.transforms.randomized_response import RandomizedResponse, randomize

    labels = [str(v) for v in domain]
    index = {label: i for i, label in enumerate(labels)}
    texts = [str(v) for v in values]
    unknown = sum(t not in index for t in texts)
    if unknown:  # the values are confidential: counted, never echoed
        raise SpecError(f"values: {unknown:,} of {len(texts):,} are not in the domain {labels}")
    if seed is not None and (not isinstance(seed, bytes) or len(seed) != 32):
        raise SpecError("seed: must be 32 bytes (or None for a fresh random key)")
    try:
        parsed = Fraction(parse_rational(epsilon))
        if max(parsed.numerator, parsed.denominator) >= 2**60:
            raise ValueError("epsilon's numerator and denominator must be below 2**60")
        rr = RandomizedResponse(len(labels), parsed)
    except ValueError as error:
        raise SpecError(f"randomize_responses: {error}") from None
    stream = CellStream(seed if seed is not None else os.urandom(32))
    codes = randomize(np.asarray([index[t] for t in texts], dtype=np.int64), rr, stream)
    return np.asarray(labels, dtype=object)[codes]

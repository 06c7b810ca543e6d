"""The Beam engine: the release pipeline as Beam transforms over column batches.

    input files -> ReadInputBatches -> EncodeRecords -> BoundContributions (shard by unit)
    -> CountCells (sparse count vectors) -> AddNoise (each public cell range's parts summed and released in
       the workers)
    -> WriteNoisyRanges (one .npy per range) -> the driver assembles, post-processes and publishes
       with the engine-neutral code, as the other engines do.

A `select: mst` query's candidates are scored before that by two pipelines (the 1-way tables released, then
ScoreCandidates range by range in the workers); only integer scores reach the driver.

The DirectRunner runs it locally (multi_processing, one worker process per core by default); any
other runner (Flink, Spark, Dataflow, ...) and its options are passed through (deploy/beam/README.md).
The same spec, input and key give a byte-identical release on every engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

from dprelease.accounting.errors import DPReleaseError, SpecError
from dprelease.accounting.redact import shown
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.worker_errors import public_failures

from ..housekeeping import leftover_tag, on_terminate, remove_stale, run_temporary_directory, store_leftover_tag
from ..plan import Plan
from ..source import InputSource
from ..storage import InputChanged
from .base import Engine, ProgressHook, checked_scores, kept_records_signature, no_progress
from . import launcher_watch
from .launcher_watch import MARK_PREFIX, kill_marked, run_mark

REQUIRED_OPTIONS = {
    "DataflowRunner": ("project", "region", "temp_location"),
    "FlinkRunner": (),
    "SparkRunner": (),
    "PortableRunner": ("job_endpoint",),
    "DirectRunner": (),
    "BundleBasedDirectRunner": (),
}
"""Runners documented in deploy/beam/README.md and the options each needs to be named."""
SHARDS_PER_WORKER = 4


def import_beam():
    try:
        import apache_beam as beam
    except ImportError:
        raise SpecError("--engine beam needs apache-beam: pip install \"dprelease[beam]\"") from None
    return beam


NO_SAMPLING = "disable_always_on_exception_sampling"
"""The experiment every release pipeline carries: no element of a failing step is sampled (Dataflow samples them by
default, and would show the confidential records in its console)."""


def pipeline_options(runner: str | None, options: list[str], workers: int | None = None):
    """Beam PipelineOptions for `runner` (default DirectRunner) plus the user's pass-through options.

    The DirectRunner defaults to multi_processing with one worker per core (`workers` overrides);
    other runners get what the user passed. Every pipeline carries the experiment NO_SAMPLING, and any other
    experiment or Dataflow service option about sampling (enable_data_sampling, enable_always_on_exception_sampling,
    in any case) is refused: sampled elements are records sent to the runner. Raises SpecError (exit 2) naming a
    missing required option or a conflict."""
    import_beam()
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

    flags = list(options)
    given = _parsed(flags)
    templated = [f"--{name}" for name in ("template_location", "dataflow_job_file") if given.get(name)]
    if templated:
        raise SpecError(f"pipeline options {', '.join(templated)}: a release is run, never saved as a template or job "
                        "file (a template would be re-run over other data); schedule `dprelease run` instead")
    asked = {part.strip().split("=", 1)[0].lower() for value in (given.get("experiments") or []) +
             (given.get("dataflow_service_options") or []) for part in str(value).split(",")}
    sampling = sorted(name for name in asked if "sampling" in name and name != NO_SAMPLING)
    if sampling:
        raise SpecError(f"pipeline options {', '.join(sampling)}: Beam would send the elements it samples (confidential "
                        "records) to the runner; a release never samples its data")
    if MARK_PREFIX.rstrip("=") in asked:
        raise SpecError(f"pipeline options: the experiment {MARK_PREFIX.rstrip('=')} is the engine's own (it marks a "
                        "run's worker processes); pass none")
    if given.get("runner") and runner and given["runner"] != runner:
        raise SpecError(f"--runner = {runner!r} but the pipeline options say --runner={given['runner']}; give one")
    name = runner or given.get("runner") or "DirectRunner"
    if name not in REQUIRED_OPTIONS:
        raise SpecError(f"--runner = {name!r}: allowed: {', '.join(REQUIRED_OPTIONS)} "
                        "(other runners work through PortableRunner and --job_endpoint)")
    missing = [f"--{option}" for option in REQUIRED_OPTIONS[name] if not given.get(option)]
    if missing:
        raise SpecError(f"--runner = {name}: needs pipeline option(s) {', '.join(missing)} (after --)")
    if not given.get("runner"):
        flags.append(f"--runner={name}")
    flags.append(f"--experiments={NO_SAMPLING}")  # Dataflow samples a failing step's element unless told not to
    if name == "DirectRunner":
        if not _named(flags, "direct_running_mode"):
            flags.append("--direct_running_mode=multi_processing")
        if not _named(flags, "default_sdk_harness_log_level"):  # workers share our stderr
            flags.append("--default_sdk_harness_log_level=WARNING")
        if not _named(flags, "direct_num_workers"):
            flags.append(f"--direct_num_workers={workers or os.cpu_count() or 1}")
        flags.append(f"--experiments={run_mark(os.urandom(16).hex())}")  # the run's SDK workers, for its watch
    built = PipelineOptions(flags)
    assert built.view_as(StandardOptions).runner == name
    return built


def _parsed(flags: list[str]) -> dict:
    """The options Beam reads from `flags`. Beam logs the flags it cannot parse, values included, which could be
    secrets: its logger is quieted while it parses, and unknown options are refused naming only the option."""
    from apache_beam.options.pipeline_options import PipelineOptions

    quiet = logging.getLogger("apache_beam.options.pipeline_options")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        options = PipelineOptions(flags)
        given = options.get_all_options(drop_default=True, retain_unknown_options=True)
        known = set(options.get_all_options())
    finally:
        quiet.setLevel(level)
    unknown = sorted({flag.split("=", 1)[0] for flag in flags if flag.startswith("--")
                      and flag[2:].split("=", 1)[0] not in known})
    if unknown:
        raise SpecError(f"pipeline options {', '.join(unknown)}: not options of the installed Beam (values not shown)")
    return given


def portable_direct_runner(options):
    """Beam's FnApiRunner, which is what the DirectRunner runs in `multi_processing` mode; named
    directly because the DirectRunner first tries to download and start the Prism runner, a network
    call and a different engine from the one tested here."""
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(
        beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)))


@contextlib.contextmanager
def _launching_workers(options):
    """While a pipeline of a run marked by `run_mark` (a DirectRunner's) runs here: a watch process kills the
    run's SDK workers when this process exits however it exits, a SIGKILL included (a worker still connecting then
    waited for it forever, one at work holds records), and a SIGTERM kills them before Beam's own clean-up joins
    them (`housekeeping.on_terminate`: that clean-up waited for workers that never exit, and the run hung for
    good). Only processes carrying the run's own token are killed (`launcher_watch`). Elsewhere: nothing."""
    token = _run_token(options)
    if token is None:
        yield
        return
    try:
        watch = subprocess.Popen([sys.executable, "-I", launcher_watch.__file__, token, str(os.getpid())],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        watch = None  # the SIGTERM path still kills them; a SIGKILL then may leave them
    stopped = threading.Event()

    def kill_workers() -> None:  # now, and those the runner's threads start meanwhile, until the block ends
        kill_marked(token)
        threading.Thread(target=_kill_until, args=(token, stopped), name="kill-sdk-workers", daemon=True).start()

    try:
        with on_terminate(kill_workers):
            yield
    finally:
        stopped.set()
        kill_marked(token)  # none of the run's workers outlives its pipeline
        if watch is not None:
            watch.kill()
            watch.wait()


KILL_SECONDS = 0.2
"""How often a terminated run looks again for SDK workers its runner started after the first kill."""


def _kill_until(token: str, stopped) -> None:
    """`kill_marked` every KILL_SECONDS until `stopped` is set (a worker started after the first kill)."""
    while not stopped.wait(KILL_SECONDS):
        kill_marked(token)


def _run_token(options) -> str | None:
    """The run's token among the pipeline options' experiments (`pipeline_options` adds one for the DirectRunner)."""
    from apache_beam.options.pipeline_options import DebugOptions

    for experiment in options.view_as(DebugOptions).experiments or []:
        if experiment.startswith(MARK_PREFIX):
            return experiment[len(MARK_PREFIX):]
    return None


def _named(flags: list[str], option: str) -> bool:
    """Whether the user's flags set `--option` (even to its default value)."""
    return any(flag == f"--{option}" or flag.startswith(f"--{option}=") for flag in flags)


def _result_directory(options) -> tuple[str, bool]:
    """Where this run's key file, noisy ranges, scores and validation outcome go (all confidential): a new
    directory under --temp_location when given (shared storage on a cluster; a local path is made a private
    directory by the storage layer, never inside a release; a store's prefix must be as private as the key),
    else a private local temporary directory (DirectRunner). A directory is named after the process, and those of
    launchers killed on this host (and boot and PID namespace) are removed first (in a store, once per engine, when
    it is made: `prepare_temp_location`). Returns (path, is_local)."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    from ..storage import is_uri, local_path, private_directory

    temp = options.view_as(GoogleCloudOptions).temp_location
    if temp and is_uri(temp):
        temp = _checked_store_temp(temp)
        return f"{temp}/{REMOTE_RESULTS}{store_leftover_tag()}{uuid.uuid4().hex}", False
    if temp:
        temp = local_path(temp, "--temp_location")  # file:///p is the local path /p, made private as any
        remove_stale(Path(temp), "dprelease-beam@")  # what runs killed on this host left there
        named = f"dprelease-beam@{leftover_tag()}{uuid.uuid4().hex}"
        return str(private_directory(Path(temp) / named, "--temp_location")), True
    return str(run_temporary_directory("dprelease-beam@")), True


REMOTE_RESULTS = "dprelease-beam+"
"""Name prefix of a run's result directory in a store's --temp_location: `store_leftover_tag` follows it ('@' in a
URI is user info), so the next run on the host can tell a killed launcher's."""


def prepare_temp_location(options) -> None:
    """When the engine is made (before any key, budget or data): refuse (SpecError, exit 2) a --temp_location the
    run's confidential files must not go to: a store location that is not plain or holds user info or a query
    (`_checked_store_temp`), and any location inside a published release (a manifest at it or above it; a local
    one as `private_directory` would refuse it later). Then remove, from a store location, the result directories
    of launchers killed on this host (`_remove_stale_results`), through the store opened for the check."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    from ..storage import check_outside_releases, is_uri, local_path

    temp = options.view_as(GoogleCloudOptions).temp_location
    if not temp:
        return
    why = "the run's key files, noisy values and kept records never go inside a release"
    if not is_uri(temp):
        check_outside_releases(Path(local_path(temp, "--temp_location")).absolute() / "x", "--temp_location", temp, why)
        return
    opened = _temp_store(options, _checked_store_temp(temp))
    if opened is None:
        logging.getLogger("dprelease").info("--temp_location's store cannot be listed here: result directories "
                                            "of killed launchers there, if any, are left")
        return
    import pyarrow as pa

    from ..storage.objects import RemoteRelease, release_above

    store, path = opened
    try:
        holder = release_above(RemoteRelease(store, f"{path}/x"))
    except (pa.ArrowException, OSError):
        holder = None  # cannot be listed here: the workers' writes will say so
    if holder is not None:
        raise SpecError(f"--temp_location = {shown(temp)!r}: inside the release {shown(holder)}; {why}")
    _remove_stale_results(store, path)


def _checked_store_temp(temp: str) -> str:
    """A store --temp_location without its trailing '/', refused (SpecError, exit 2) where it carries user info or a
    query (which could be credentials, and options are recorded) or a path that is not plain ('..', '.' or empty
    components: a store reads such a name as another one, perhaps inside a release)."""
    from urllib.parse import unquote, urlsplit

    from ..storage.uris import plain_store_path

    parts = urlsplit(temp)
    path = unquote(parts.netloc + parts.path if parts.scheme.lower() in ("s3", "gs", "gcs") else parts.path)
    if "@" in parts.netloc or parts.query or parts.fragment or not plain_store_path(path):
        raise SpecError(f"--temp_location = {shown(temp)!r}: allowed: a store URI with a plain path (no '..', '.' or "
                        "empty components) and no user info or query (credentials come from the environment)")
    return temp.rstrip("/")


def _remove_stale_results(store, path: str) -> list[str]:
    """Remove the result directories under a store's --temp_location (`path` in `store`, from `_temp_store`) whose
    launcher on this host is gone (a SIGKILLed run's key files, noisy ranges and kept records); another host's, a
    live launcher's and a name that does not parse are left. Listed and removed through pyarrow with short timeouts,
    not Beam's filesystems (whose S3 listing retries an empty or failed listing with backoff for minutes); a listing
    that fails removes nothing. Returns the URIs removed."""
    from ..housekeeping import process_alive
    from ..storage import remove_stale_remote

    return remove_stale_remote(store, path, REMOTE_RESULTS, process_alive)


def _temp_store(options, temp: str):
    """(a pyarrow store, the path of `temp` in it) for a store --temp_location, opened with the connection settings
    Beam's own options give (`--s3_endpoint_url`, `--s3_region_name`, `--s3_disable_ssl`, and any credentials
    given as options; otherwise the environment's, as Beam's client reads them); None for a store that is not an
    object store (hdfs: a prefix there could be a link, which a recursive delete would follow) or one pyarrow
    cannot open."""
    import datetime
    from urllib.parse import urlsplit

    import pyarrow as pa
    import pyarrow.fs as pafs
    from apache_beam.options.pipeline_options import S3Options

    from ..storage import Store

    scheme, rest = temp.split("://", 1)
    try:
        if scheme.lower() == "s3":
            s3 = options.view_as(S3Options)
            endpoint = urlsplit(s3.s3_endpoint_url) if s3.s3_endpoint_url else None
            filesystem = pafs.S3FileSystem(
                access_key=s3.s3_access_key_id, secret_key=s3.s3_secret_access_key, session_token=s3.s3_session_token,
                region=s3.s3_region_name, endpoint_override=endpoint.netloc if endpoint else None,
                scheme=(endpoint.scheme if endpoint else None) or ("http" if s3.s3_disable_ssl else "https"),
                connect_timeout=5, request_timeout=20,
                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2))
            return Store(filesystem, "s3://"), rest
        if scheme.lower() in ("gs", "gcs"):  # retries bounded (found by review: the default retried for minutes)
            filesystem = pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=5))
            return Store(filesystem, f"{scheme}://"), rest
        return None  # a file system with links (hdfs): never swept by name from here
    except (pa.ArrowException, OSError, ValueError):
        return None


def _write_private(path: str, data: bytes) -> None:
    """A file only this run reads: owner-only (0600) in the local result directory (itself 0700); in a remote
    --temp_location, an object as private as that location (deploy/beam/README.md)."""
    if "://" not in path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as handle:
        handle.write(data)


def _delete_remote(directory: str) -> None:
    """Remove a run's directory in the --temp_location store: every object under it (the key files, noisy ranges,
    scores, validation outcome, kept records). Beam's object stores delete a prefix only when it ends in '/' (a
    name without one is taken as one object's: nothing was removed). Best effort: what is left is logged, by count,
    never raised (the run's outcome is already decided)."""
    from apache_beam.io.filesystems import FileSystems

    prefix = directory.rstrip("/") + "/"
    log = logging.getLogger("dprelease")
    try:
        FileSystems.delete([prefix])
    except Exception as error:  # noqa: BLE001 - cleanup must not hide the run's outcome
        log.warning("could not delete %s (%s)", shown(directory), type(error).__name__)
    try:
        left = len(FileSystems.match([prefix + "**"])[0].metadata_list)
    except Exception:  # noqa: BLE001 - nothing matched, or the store cannot be listed: said below
        left = None
    if left != 0:
        log.warning("%s objects of this run are left under %s (confidential: remove them)",
                    "some" if left is None else left, shown(directory))


def _remove_result_directory(directory: str, local: bool) -> None:
    """Remove a directory `_result_directory` made, with everything in it."""
    if local:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        _delete_remote(directory)


def _route(element, token: tuple, shipped: tuple[str, str], table_ids: dict[str, int]):
    """A released range as dataflow pieces keyed by the post-processing group that reads them."""
    from ..dataflow import bounded, noise_piece, route_noise

    name, start, values = element
    flow = _shipped_flow(token, shipped)
    for piece in route_noise(flow, noise_piece(flow, table_ids[name], start, values)):
        yield from ((part.key, part) for part in bounded(piece))


def _run_group(element, token: tuple, shipped: tuple[str, str]):
    """One group of a post-processing or writing stage, in a worker. Its output travels in pieces of at
    most `dataflow.MAX_PIECE_BYTES` (elements a runner can shuffle and spill one at a time)."""
    from ..dataflow import bounded, run_group

    key, pieces = element
    for piece in run_group(_shipped_flow(token, shipped), key, list(pieces)):
        yield from ((part.key, part) for part in bounded(piece))


def _ship_flow(flow, directory: str) -> tuple[str, str]:
    """The plan and the driver's tree pickled together into the run's result directory, once: (path, SHA-256), what
    the post-processing transforms carry instead of the objects (Beam compresses every transform's pickle, several
    times each: 2.4 MB and 0.27 s a time for a country's geography)."""
    import pickle

    from apache_beam.io.filesystems import FileSystems

    data = pickle.dumps((flow.plan, flow.tree), protocol=5)
    path = f"{directory}/flow.pickle"
    with FileSystems.create(path) as handle:
        handle.write(data)
    return path, hashlib.sha256(data).hexdigest()


def _shipped_flow(token: tuple, shipped: tuple[str, str]):
    """The run's Flow in a worker (`dataflow.flow_from`): the shipped file is read once per process, and unpickled
    only when its bytes are the ones the launcher wrote (their SHA-256 travels with the transforms)."""
    from ..dataflow import flow_from

    def load() -> bytes:
        from apache_beam.io.filesystems import FileSystems

        path, digest = shipped
        with FileSystems.open(path) as handle:
            data = handle.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise DPReleaseError("the plan file of the Beam pipeline changed after the launcher wrote it")
        return data

    return flow_from(token, load)


def _write_kept_count(count: int, path: str) -> None:
    """The number of files of kept records, for the launcher to check its listing against (a retry rewrites it)."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as handle:
        handle.write(json.dumps({"files": int(count)}).encode("utf-8"))


def _read_kept_count(directory: str) -> int:
    """How many files of kept records the keep pipeline wrote (`_write_kept_count`, in the result directory)."""
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(f"{directory}/kept.json") as handle:
            return int(json.loads(handle.read().decode("utf-8"))["files"])
    except (OSError, ValueError, KeyError) as error:
        raise DPReleaseError(f"the Beam selection pipeline's count of kept records cannot be read "
                             f"({type(error).__name__}): --temp_location must be storage that the workers and the "
                             "launcher share") from None


def _named_task_batches(element, reader, encoders: dict):
    """(task-<read task>-<batch>, encoded batch) of one numbered read task, without a privacy unit: the names are
    a pure function of the records (a task's batches come in the same order every time it is read)."""
    import pyarrow as pa

    from dprelease.transforms.encode import encoded_table

    index, task = element
    for number, batch in enumerate(reader.batches(task)):
        table = encoded_table(pa.Table.from_batches([batch]), encoders, None)
        if table.num_rows:
            yield f"task-{index:06d}-{number:06d}", table


def _in_stage(element, prefixes: frozenset) -> bool:
    from ..dataflow import FILES, stage_of

    return element[1].kind != FILES and stage_of(element[0]) in prefixes


def _grouped(element, heads: dict):
    """(the group a piece is run in: `dataflow.group_key`, the piece)."""
    from ..dataflow import group_key

    return group_key(heads, element[0]), element[1]


def _write_document(document: bytes, directory: str, prefix: str = "") -> None:
    """One small JSON document into the result directory, named by its content (a retried bundle rewrites the
    same file)."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(f"{directory}/{prefix}{hashlib.sha256(document).hexdigest()}.json") as handle:
        handle.write(document)


def _read_documents(directory: str, prefix: str = "") -> list[bytes]:
    """Every document `_write_document` wrote into the result directory with `prefix`."""
    from apache_beam.io.filesystems import FileSystems

    documents = []
    for metadata in FileSystems.match([f"{directory}/{prefix}*.json"])[0].metadata_list:
        with FileSystems.open(metadata.path) as handle:
            documents.append(handle.read())
    return documents


def _write_entries(element, directory: str):
    """A group's file entries, as one small JSON file in the result directory (named by its content)."""
    _write_document(bytes(element[1].arrays["files"]), directory)
    yield 1


def post_process_and_write(noisy, flow, token: tuple, directory: str):
    """Released ranges (a PCollection) -> every table part written into the flow's staging directory,
    post-processed per group of units (`pipelines.dataflow`: per stage a Filter of the pools it reads, a
    GroupByKey by `group_key` and a kernel per group), each group's file entries into `directory`. The plan and the
    driver's tree (its operators are never recomputed in workers) travel once, as a file in `directory` checked by
    its SHA-256 (`_ship_flow`), not inside every stage's transform."""
    beam = import_beam()
    from ..dataflow import FILES, stage_order, stage_sources

    table_ids = {t.name: i for i, t in enumerate(flow.plan.tables)}
    shipped = _ship_flow(flow, directory)
    routed = beam.FlatMap(public_failures("route noise", _route), token, shipped, table_ids)
    pools = [noisy | "RouteNoise" >> routed]
    stages = stage_order(flow)
    for i, (prefixes, sources) in enumerate(zip(stages, stage_sources(flow, stages))):
        chosen = [pools[j] | f"Stage{i}From{j}" >> beam.Filter(_in_stage, frozenset(prefixes)) for j in sources]
        pools.append(chosen
                     | f"Stage{i}Inputs" >> beam.Flatten()
                     | f"Stage{i}Keys" >> beam.Map(_grouped, flow.heads)
                     | f"Stage{i}Groups" >> beam.GroupByKey()
                     | f"Stage{i}Run" >> beam.FlatMap(public_failures("post-process", _run_group), token, shipped))
    files = [pool | f"Files{j}" >> beam.Filter(lambda element: element[1].kind == FILES)
             for j, pool in enumerate(pools[1:])]
    written = beam.FlatMap(public_failures("write", _write_entries), directory)
    return files | "AllFiles" >> beam.Flatten() | "WriteEntries" >> written


def _read_entries(directory: str) -> list:
    """The groups' file-entry documents written by `_write_entries`, as FILES pieces."""
    from ..dataflow import FILES, Piece

    return [Piece(0, FILES, 0, 0, 0, {"files": np.frombuffer(document, dtype=np.uint8)})
            for document in _read_documents(directory)]


def beam_write_scores(directory: str):
    """(table, (score, ranges)) -> one small JSON file per table under `directory` (any Beam filesystem)."""
    beam = import_beam()

    def write(element):
        from apache_beam.io.filesystems import FileSystems

        name, (score, ranges) = element
        path = f"{directory}/score-{hashlib.sha256(name.encode()).hexdigest()[:16]}.json"
        with FileSystems.create(path) as handle:
            handle.write(json.dumps({"table": name, "score": int(score), "ranges": int(ranges)}).encode("utf-8"))
        yield path

    return beam.FlatMap(public_failures("write scores", write))


def _read_scores(directory: str) -> dict[str, tuple[int, int]]:
    """The (score, ranges scored) `beam_write_scores` wrote, by table name."""
    from apache_beam.io.filesystems import FileSystems

    scores = {}
    for metadata in FileSystems.match([f"{directory}/score-*.json"])[0].metadata_list:
        with FileSystems.open(metadata.path) as handle:
            document = json.loads(handle.read().decode("utf-8"))
        scores[document["table"]] = int(document["score"]), int(document["ranges"])
    return scores


COPY_SHARES = 64
"""Most shares of the staged parts a Beam copy pipeline hands its workers (each share copied COPY_THREADS at once
by `storage.copy_checked`)."""


def _copy_share(share: list, release_uri: str, release_path: str):
    """A share of staged parts copied into the release and read back (`storage.copy_checked`): (name, SHA-256)."""
    from ..storage import copy_checked

    yield copy_checked(release_uri, release_path, [tuple(part) for part in share])


def _write_digests(digests: list, directory: str):
    """A share's (name, SHA-256) pairs as one small JSON file in the result directory (named by its content)."""
    _write_document(json.dumps(sorted(digests)).encode("utf-8"), directory, "copied-")
    yield 1


def _read_digests(directory: str) -> list[tuple[str, str]]:
    """Every (name, SHA-256) pair `_write_digests` wrote."""
    return [(str(name), str(digest)) for document in _read_documents(directory, "copied-")
            for name, digest in json.loads(document.decode("utf-8"))]


class BeamEngine(Engine):
    name = "beam"
    writes_parts = True

    def __init__(self, runner: str | None = None, options: list[str] | None = None, workers: int | None = None):
        self.options = pipeline_options(runner, list(options or []), workers)
        prepare_temp_location(self.options)  # before any key, budget or data (found by review: it ran after the charge)
        self.workers = workers or os.cpu_count() or 1
        self._directory: str | None = None
        self._key_inputs: dict[int, object] = {}
        self._kept: tuple | None = None
        """(signature, directory, is_local, paths) of the bounded records a selection keeps for its later passes."""

    def temp_inside(self, release_uri: str) -> bool:
        """Whether a store --temp_location lies in (or is) the release's own prefix `release_uri`."""
        from apache_beam.options.pipeline_options import GoogleCloudOptions

        from ..storage import is_uri

        temp = self.options.view_as(GoogleCloudOptions).temp_location
        if not temp or not is_uri(temp):
            return False
        temp, release = temp.rstrip("/"), release_uri.rstrip("/")
        return temp == release or temp.startswith(release + "/")

    def _key_input(self, pipeline, key: ReleaseKey):
        """The key as this run's workers get it: a singleton read when the pipeline runs from a private file in the
        run's result directory (written here once per pipeline, removed with the directory), so the pipeline's
        graph holds a path, never the key."""
        found = self._key_inputs.get(id(pipeline))
        if found is None:
            from dprelease.transforms.beam import KeyFromFile

            path = f"{self._directory}/key-{len(self._key_inputs)}"
            _write_private(path, key.exported())
            found = self._key_inputs[id(pipeline)] = pipeline | "ReleaseKey" >> KeyFromFile(path)
        return found

    def _runner(self):
        from apache_beam.options.pipeline_options import StandardOptions

        if self.options.view_as(StandardOptions).runner == "DirectRunner":
            return portable_direct_runner(self.options)
        return None  # Beam resolves the named runner from the options

    def build(self, pipeline, plan: Plan, source: InputSource, key: ReleaseKey, directory: str):
        """The release's transforms, applied to `pipeline`; ends in one .npy file per noisy range."""
        from dprelease.transforms.beam import WriteNoisyRanges

        noisy = self.noisy_ranges(pipeline, plan, source, key)
        return noisy | "Write" >> WriteNoisyRanges(directory, {t.name: i for i, t in enumerate(plan.tables)})

    def noisy_ranges(self, pipeline, plan: Plan, source: InputSource, key: ReleaseKey,
                     steps: dict[str, int] | None = None):
        """Input files -> (table, output start, released values) for every range of every table."""
        from dprelease.transforms.beam import AddNoise, CountCells

        counts = (self._bounded(pipeline, plan, source, key)  # each range's parts summed where its noise is drawn
                  | "Count" >> CountCells([t.layout for t in plan.tables], combined=False))
        return counts | "AddNoise" >> AddNoise.from_plan(plan, self._key_input(pipeline, key), steps=steps)

    def _bounded(self, pipeline, plan: Plan, source: InputSource, key: ReleaseKey):
        """Input files -> encoded batches, at most the plan's k records per unit (the records kept depend on
        the plan's encoded columns only)."""
        encoded = self._encoded(pipeline, plan, source)
        if source.unit_column:
            encoded = encoded | "Bound" >> self._bounding(pipeline, plan, source, key)
        return encoded

    def _encoded(self, pipeline, plan: Plan, source: InputSource):
        beam = import_beam()
        from dprelease.transforms.beam import EncodeRecords, ReadInputBatches

        return (pipeline
                | "InputFiles" >> beam.Create(source.read_tasks(self.workers))
                | "Read" >> ReadInputBatches(source.reader())
                | "Encode" >> EncodeRecords.from_plan(plan))

    def _bounding(self, pipeline, plan: Plan, source: InputSource, key: ReleaseKey):
        from dprelease.transforms.beam import BoundContributions

        shards = max(self.workers * SHARDS_PER_WORKER, -(-source.estimated_rows() // 1_000_000))
        return BoundContributions.from_plan(plan, self._key_input(pipeline, key), shards)

    def _named_bounded(self, pipeline, plan: Plan, source: InputSource, key: ReleaseKey):
        """(name, bounded encoded table) pairs whose names are a pure function of the records (`KeepRecords`): a
        shard's number, or, without a privacy unit (nothing to bound), a read task's batch."""
        beam = import_beam()
        from dprelease.transforms.beam import EncodeRecords

        if source.unit_column:
            return (self._bounding(pipeline, plan, source, key).bounded_shards(self._encoded(pipeline, plan, source))
                    | "Name" >> beam.MapTuple(lambda shard, table: (f"shard-{shard:06d}", table)))
        encoders = EncodeRecords.from_plan(plan).encoders
        return (pipeline
                | "InputFiles" >> beam.Create(list(enumerate(source.read_tasks(self.workers))))
                | "Spread" >> beam.Reshuffle()
                | "ReadAndEncode" >> beam.FlatMap(public_failures("read and encode", _named_task_batches),
                                                  source.reader(), encoders))

    def _keep(self, plan: Plan, source: InputSource, key: ReleaseKey) -> None:
        """Read, encode and bound the input over `plan`'s encoded columns in a pipeline of its own, once a run, and
        keep the bounded records in private files (the run's result storage: a private local directory, or the
        --temp_location store) until `close`; a later call over the same columns, key and input keeps them."""
        from apache_beam.io.filesystems import FileSystems

        from dprelease.transforms.beam import KEPT_PATTERN, KeepRecords

        signature = kept_records_signature(plan, source, key)
        if self._kept is not None and self._kept[0] == signature:
            return
        self._drop_kept()
        directory, local = _result_directory(self.options)
        self._kept = (None, directory, local, [])  # removed by `close` whatever happens next
        columns = plan.encoded_columns()

        def build(pipeline, results: str) -> None:
            beam = import_beam()
            written = self._named_bounded(pipeline, plan, source, key) | "Keep" >> KeepRecords(directory, columns)
            (written | "CountKept" >> beam.combiners.Count.Globally()
             | "WriteCount" >> beam.Map(_write_kept_count, f"{results}/kept.json"))

        written = self._run("the Beam selection pipeline", build, _read_kept_count)
        paths = sorted(m.path for m in FileSystems.match([f"{directory}/{KEPT_PATTERN}"])[0].metadata_list)
        if len(paths) != written:  # every pass would count from other records than were bounded
            raise DPReleaseError(f"the Beam selection pipeline kept {written} files of bounded records and the "
                                 f"launcher finds {len(paths)}: --temp_location must be storage that the workers and "
                                 "the launcher share")
        self._kept = (signature, directory, local, paths)

    def _kept_records(self, pipeline):
        """The bounded records `_keep` kept, read back from their files (never the input)."""
        from dprelease.transforms.beam import ReadKeptRecords

        return pipeline | "Kept" >> ReadKeptRecords(self._kept[3])

    def _drop_kept(self) -> None:
        if self._kept is not None:
            _, directory, local, _ = self._kept
            self._kept = None
            _remove_result_directory(directory, local)

    def close(self) -> None:
        """Remove the bounded records a selection kept."""
        self._drop_kept()

    scores_candidates = True

    def score_candidates(self, plan: Plan, counting: list, one_way: list, estimates, source: InputSource,
                         key: ReleaseKey, progress: ProgressHook = no_progress) -> dict[str, int]:
        """Two pipelines over the records bounded as for `counting`: the 1-way tables released (the values
        the release publishes), then every candidate scored in the workers, range by range, from the
        estimates the driver computed; only integer scores come back (no true count reaches the driver). Both
        read the bounded records `_keep` kept: the input is read, encoded and bounded once a run, and every
        later pass over the same columns (a `select: aim` query's) counts from the same records."""
        from dprelease.transforms.beam import AddNoise, CountCells, ScoreCandidates, WriteNoisyRanges

        counting_plan = dataclasses.replace(plan, tables=tuple(counting))
        one_way_plan = dataclasses.replace(plan, tables=tuple(one_way))
        progress("select", 0, 2)
        self._keep(counting_plan, source, key)

        def release_one_way(pipeline, directory: str) -> None:
            (self._kept_records(pipeline)
             | "Count" >> CountCells([t.layout for t in one_way], combined=False)
             | "AddNoise" >> AddNoise.from_plan(one_way_plan, self._key_input(pipeline, key))
             | "Write" >> WriteNoisyRanges(directory, {t.name: i for i, t in enumerate(one_way)}))

        released = self._run("the Beam selection pipeline", release_one_way,
                             lambda directory: self._assemble(one_way_plan, directory))
        progress("select", 1, 2)
        wanted = estimates(released)
        candidates = [t for t in counting if t.name in wanted]

        scorer = ScoreCandidates({t.name: t.release for t in candidates}, wanted)

        def score(pipeline, directory: str) -> None:
            (self._kept_records(pipeline)
             | "Count" >> CountCells([t.layout for t in candidates], combined=False)
             | "Score" >> scorer
             | "Write" >> beam_write_scores(directory))

        scores = self._run("the Beam selection pipeline", score, _read_scores)
        progress("select", 2, 2)
        return checked_scores(scores, scorer.expected_ranges(), "the Beam selection pipeline")

    def release_parts(self, plan: Plan, source: InputSource, key: ReleaseKey, staging, staging_token: str, layout,
                      progress: ProgressHook = no_progress):
        """The whole release after the input, in the Beam workers: noise, post-processing stage by stage,
        every table part written into `staging` (a directory every worker reaches); each group's file
        entries come back through the result directory: all the driver reads."""
        from ..dataflow import Flow, range_length, results, run_token

        flow = Flow(plan, layout, str(staging))
        token = run_token(plan, layout, staging, staging_token)
        steps = {t.name: range_length(flow, i) for i, t in enumerate(plan.tables)}

        def build(pipeline, directory: str) -> None:
            post_process_and_write(self.noisy_ranges(pipeline, plan, source, key, steps), flow, token, directory)

        progress("beam-release", 0, 1)
        found = self._run("the Beam pipeline", build, _read_entries)
        progress("beam-release", 1, 1)
        return results(found)

    copies_parts = True

    def copy_parts(self, release_uri: str, release_path: str, parts) -> list[tuple[str, str]]:
        """The staged parts copied into the release and read back in the Beam workers (`storage.copy_checked`,
        in at most COPY_SHARES shares): each copy's name and SHA-256 come back through the result directory,
        never its bytes."""
        beam = import_beam()
        parts = [tuple(part) for part in parts]
        if not parts:
            return []
        count = min(len(parts), COPY_SHARES)
        shares = [parts[i::count] for i in range(count)]

        def build(pipeline, directory: str) -> None:
            (pipeline
             | "Shares" >> beam.Create(shares)
             | "Spread" >> beam.Reshuffle()
             | "Copy" >> beam.FlatMap(public_failures("copy parts", _copy_share), release_uri, release_path)
             | "Write" >> beam.FlatMap(public_failures("write digests", _write_digests), directory))

        return self._run("the Beam copy pipeline", build, _read_digests)

    def _run(self, what: str, build, read):
        """Build a pipeline with `build(pipeline, directory)`, run it, return `read(directory)`; any
        runner error becomes a public-only message; the result directory is removed afterwards."""
        beam = import_beam()
        directory, local = _result_directory(self.options)
        self._directory, self._key_inputs = directory, {}
        try:
            try:
                with _launching_workers(self.options), \
                        beam.Pipeline(runner=self._runner(), options=self.options) as pipeline:
                    build(pipeline, directory)
            except Exception as error:  # runner errors may quote data; keep the message public-only
                raise InputChanged.in_worker(error) or DPReleaseError(f"{what} failed: {type(error).__name__}") \
                    from error
            return read(directory)
        finally:
            self._directory, self._key_inputs = None, {}
            _remove_result_directory(directory, local)

    def validate_input(self, plan: Plan, source: InputSource, runner):
        """The value-level expectations in the Beam workers: a great-expectations call per batch
        (each worker builds the suite once), outcomes merged by a combine, one JSON result read back.
        Confidential: the caller writes it to the internal directory only."""
        beam = import_beam()
        from apache_beam.io.filesystems import FileSystems

        from dprelease.pipelines.validation import ValidationOutcome
        from dprelease.transforms.beam import ReadInputBatches

        from .beam_validation import ValidateBatches

        expectations = runner.expectations

        def build(pipeline, directory: str) -> None:
            (pipeline
             | "InputFiles" >> beam.Create(source.read_tasks(self.workers))
             | "Read" >> ReadInputBatches(source.reader())
             | "Validate" >> ValidateBatches(expectations, plan, f"{directory}/validation.json"))

        def read(directory: str) -> ValidationOutcome:
            with FileSystems.open(f"{directory}/validation.json") as handle:
                merged = json.loads(handle.read().decode("utf-8"))
            return ValidationOutcome(expectations, {int(k): v for k, v in merged["results"].items()},
                                     merged["batches"])

        return self._run("input validation on Beam", build, read)

    def noisy_measurements(self, plan: Plan, source: InputSource, key: ReleaseKey,
                           progress: ProgressHook = no_progress) -> dict[str, np.ndarray]:
        progress("beam", 0, 1)
        noisy = self._run("the Beam pipeline", lambda pipeline, directory: self.build(pipeline, plan, source, key, directory),
                          lambda directory: self._assemble(plan, directory))
        progress("beam", 1, 1)
        return noisy

    @staticmethod
    def _assemble(plan: Plan, directory: str) -> dict[str, np.ndarray]:
        from apache_beam.io.filesystems import FileSystems

        vectors = [np.zeros(t.n_outputs, dtype=np.int64) for t in plan.tables]
        covered = [0] * len(plan.tables)
        for metadata in FileSystems.match([f"{directory}/*.npy"])[0].metadata_list:
            table_id, start = (int(part) for part in os.path.basename(metadata.path)[:-4].split("-"))
            with FileSystems.open(metadata.path) as handle:
                values = np.load(io.BytesIO(handle.read()), allow_pickle=False)
            vectors[table_id][start:start + values.size] = values
            covered[table_id] += values.size
        for t, vector, cells in zip(plan.tables, vectors, covered):
            if cells != t.n_outputs:
                raise DPReleaseError(f"table {t.name}: the Beam pipeline returned {cells} of {t.n_outputs} values")
        return {t.name: vector for t, vector in zip(plan.tables, vectors)}

"""The Beam engine: the release pipeline as Beam transforms over column batches.

    input files -> ReadInputBatches -> EncodeRecords -> BoundContributions (shard by unit)
    -> CountCells (combine of sparse count vectors) -> AddNoise (per public cell range, in workers)
    -> WriteNoisyRanges (one .npy per range) -> the driver assembles, post-processes and publishes
       with the engine-neutral code, as the other engines do.

The DirectRunner runs it locally (multi_processing, one worker process per core by default); any
other runner (Flink, Spark, Dataflow, ...) and its options are passed through (deploy/beam/README.md).
The same spec, input and key give a byte-identical release on every engine.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import uuid

import numpy as np

from dprelease.accounting.errors import DPReleaseError, SpecError
from dprelease.transforms.csprng import ReleaseKey

from ..plan import Plan
from ..source import InputSource
from .base import Engine, ProgressHook, no_progress

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


def pipeline_options(runner: str | None, options: list[str], workers: int | None = None):
    """Beam PipelineOptions for `runner` (default DirectRunner) plus the user's pass-through options.

    The DirectRunner defaults to multi_processing with one worker per core (`workers` overrides);
    other runners get exactly what the user passed. Raises SpecError (exit 2) naming a missing
    required option or a conflict."""
    import_beam()
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

    flags = list(options)
    given = PipelineOptions(flags).get_all_options(drop_default=True)
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
    if name == "DirectRunner":
        if not _named(flags, "direct_running_mode"):
            flags.append("--direct_running_mode=multi_processing")
        if not _named(flags, "default_sdk_harness_log_level"):  # workers share our stderr
            flags.append("--default_sdk_harness_log_level=WARNING")
        if not _named(flags, "direct_num_workers"):
            flags.append(f"--direct_num_workers={workers or os.cpu_count() or 1}")
    built = PipelineOptions(flags)
    assert built.view_as(StandardOptions).runner == name
    return built


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


def _named(flags: list[str], option: str) -> bool:
    """Whether the user's flags set `--option` (even to its default value)."""
    return any(flag == f"--{option}" or flag.startswith(f"--{option}=") for flag in flags)


def _result_directory(options) -> tuple[str, bool]:
    """Where workers write the noisy ranges: --temp_location/<id> when given (shared storage on a
    cluster), else a local temporary directory (DirectRunner). Returns (path, is_local_temp)."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    temp = options.view_as(GoogleCloudOptions).temp_location
    if temp:
        return f"{temp.rstrip('/')}/dprelease-{uuid.uuid4().hex}", False
    return tempfile.mkdtemp(prefix="dprelease-beam-"), True


def _delete_remote(directory: str) -> None:
    """Remove the noisy ranges from shared storage (best effort: a failure is logged, not raised)."""
    from apache_beam.io.filesystems import FileSystems

    try:
        paths = [m.path for m in FileSystems.match([f"{directory}/*"])[0].metadata_list]
        if paths:
            FileSystems.delete(paths)
    except Exception as error:  # noqa: BLE001 - cleanup must not hide the run's outcome
        logging.getLogger("dprelease").warning("could not delete %s (%s)", directory, type(error).__name__)


class BeamEngine(Engine):
    name = "beam"

    def __init__(self, runner: str | None = None, options: list[str] | None = None, workers: int | None = None):
        self.options = pipeline_options(runner, list(options or []), workers)
        self.workers = workers or os.cpu_count() or 1

    def _runner(self):
        from apache_beam.options.pipeline_options import StandardOptions

        if self.options.view_as(StandardOptions).runner == "DirectRunner":
            return portable_direct_runner(self.options)
        return None  # Beam resolves the named runner from the options

    def build(self, pipeline, plan: Plan, source: InputSource, key: ReleaseKey, directory: str):
        """The release's transforms, applied to `pipeline`; ends in one .npy file per noisy range."""
        beam = import_beam()
        from dprelease.transforms.beam import (AddNoise, BoundContributions, CountCells, EncodeRecords,
                                               ReadInputBatches, WriteNoisyRanges)

        columns = source.columns
        encoded = (pipeline
                   | "InputFiles" >> beam.Create(source.files())
                   | "Read" >> ReadInputBatches(columns, source.format)
                   | "Encode" >> EncodeRecords.from_plan(plan))
        if source.unit_column:
            shards = max(self.workers * SHARDS_PER_WORKER, -(-source.estimated_rows() // 1_000_000))
            encoded = encoded | "Bound" >> BoundContributions.from_plan(plan, key, shards)
        counts = encoded | "Count" >> CountCells([t.layout for t in plan.tables])
        noisy = counts | "AddNoise" >> AddNoise.from_plan(plan, key)
        return noisy | "Write" >> WriteNoisyRanges(directory, {t.name: i for i, t in enumerate(plan.tables)})

    def _run(self, what: str, build, read):
        """Build a pipeline with `build(pipeline, directory)`, run it, return `read(directory)`; any
        runner error becomes a public-only message; the result directory is removed afterwards."""
        beam = import_beam()
        directory, local = _result_directory(self.options)
        try:
            try:
                with beam.Pipeline(runner=self._runner(), options=self.options) as pipeline:
                    build(pipeline, directory)
            except Exception as error:  # runner errors may quote data; keep the message public-only
                raise DPReleaseError(f"{what} failed: {type(error).__name__}") from error
            return read(directory)
        finally:
            if local:
                shutil.rmtree(directory, ignore_errors=True)
            else:
                _delete_remote(directory)

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
             | "InputFiles" >> beam.Create(source.files())
             | "Read" >> ReadInputBatches(source.columns, source.format)
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

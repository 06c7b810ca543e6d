"""A whole release inside a user's own Beam pipeline (deploy/beam/README.md): read Parquet as Arrow batches,
publish every table with `PublishedTables`, write each table to DIR/<name>.parquet.

    python examples/beam_release.py SPEC INPUT.parquet OUT_DIR [beam pipeline options...]

The key is drawn when the pipeline runs, fresh each run, never in the pipeline graph; budget accounting, the
manifest and verify are the launcher's (`dprelease run --engine beam`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions

import dprelease
from dprelease.transforms.beam_release import PublishedTables


def write_table(element, directory: str) -> None:
    name, table = element
    pq.write_table(table, Path(directory) / f"{name}.parquet")


def main(spec: str, data: str, out: str, options: list[str]) -> None:
    release = dprelease.Release.from_yaml(spec)
    Path(out).mkdir(parents=True, exist_ok=True)
    with beam.Pipeline(options=PipelineOptions(options or ["--direct_running_mode=in_memory"])) as pipeline:
        (pipeline
         | "Read" >> beam.io.ReadFromParquetBatched(data)
         | "Release" >> PublishedTables.from_spec(release)
         | "Write" >> beam.Map(write_table, out))


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])

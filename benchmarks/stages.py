"""The stages of one release in one process, timed: noisy measurements (read, encode, bound, count, noise),
post-processing (per-unit estimate, joint fit and integer step), writing (tables, measurements, manifest);
published cells per second of post-processing, the least-squares estimate alone (timed apart, not part of
the total), and the peak resident memory of this process and of the largest worker process.
Usage: python benchmarks/stages.py SPEC INPUT [WORKERS]   (WORKERS 0 or absent: every core)
"""
from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from dprelease.pipelines.engines.embedded import EmbeddedEngine
from dprelease.pipelines.layout import Layout
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.postprocessing import estimation_path, least_squares_estimates, post_process
from dprelease.pipelines.provenance import Invocation
from dprelease.pipelines.release import stage_release
from dprelease.pipelines.run import bind_release_key
from dprelease.pipelines.source import open_input
from dprelease.pipelines.spec import load_spec
from dprelease.transforms.csprng import ReleaseKey


def main(spec_path: str, input_path: str, workers: int) -> None:
    workers = workers or os.cpu_count() or 1
    spec, base = load_spec(Path(spec_path))
    plan = build_plan(spec, base)
    source = open_input(plan, base, input_path)
    key, _ = bind_release_key(ReleaseKey.generate(), plan, source)
    engine = EmbeddedEngine(workers=workers)
    start = time.perf_counter()
    noisy = engine.noisy_measurements(plan, source, key)
    measured = time.perf_counter()
    published = post_process(plan, noisy, workers=workers)
    processed = time.perf_counter()
    least_squares_estimates(plan, noisy)  # the estimate alone (both passes, no integer step), in this process
    estimated = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        staged = stage_release(plan, noisy, published, Path(out) / spec.release_id, engine="embedded", key_id="0" * 16,
                               created_at="2026-01-01T00:00:00+00:00", invocation=Invocation("benchmark stages.py"),
                               layout=Layout(),
                               workers=workers)
        written = time.perf_counter()
        staged.discard()
    cells = sum(t.n_outputs for t in plan.tables)
    print(f"{spec.release_id}: {source.estimated_rows():,} rows, {cells:,} published cells, {workers} worker(s); "
          f"{estimation_path(plan)}")
    print(f"  noisy measurements {measured - start:8.2f} s")
    print(f"  post-processing    {processed - measured:8.2f} s  ({cells / (processed - measured):,.0f} published cells/s)")
    print(f"  (the least-squares estimate alone, timed apart in one process: {estimated - processed:.2f} s)")
    print(f"  writing            {written - estimated:8.2f} s")
    print(f"  total              {processed - start + written - estimated:8.2f} s; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB "
          f"(this process), {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.2f} GiB (largest worker)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)

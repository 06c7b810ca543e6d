"""The Beam engine: byte-identical to the embedded engine (and Spark) on the DirectRunner with two
worker processes, safe under bundle retries, with reusable PTransforms and pass-through runner options."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from dprelease.accounting.errors import DPReleaseError, SpecError
from dprelease.accounting.ledger import ABORTED, history, open_ledger, set_budget
from dprelease.pipelines.commands import demo_data
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.run import run_release
from dprelease.pipelines.spec import load_spec

from .conftest import DEMO_SPEC
from .test_spark import assert_same_release
from .test_storage import credentials, s3  # noqa: F401 - fixtures

beam = pytest.importorskip("apache_beam")

from dprelease.pipelines.engines.beam import pipeline_options  # noqa: E402

ROWS = 60_000
DIRECT = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo input split over two Parquet files (several row groups each) and its embedded release."""
    root = tmp_path_factory.mktemp("beam")
    data, _ = demo_data(ROWS, root / "one", seed=11)
    table = pq.read_table(data)
    (root / "data").mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), root / "data" / "part-0.parquet", row_group_size=10_000)
    pq.write_table(table.slice(half), root / "data" / "part-1.parquet", row_group_size=10_000)
    key = root / "demo.key"
    embedded = run_release(DEMO_SPEC, input_path=str(root / "data"), out_dir=root / "embedded", key_file=key)
    return {"root": root, "data": root / "data", "key": key, "embedded": embedded.release_dir}


def test_direct_runner_with_two_workers_is_byte_identical_to_embedded(demo):
    result = run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=demo["root"] / "beam", key_file=demo["key"],
                         engine="beam", beam_options=DIRECT)
    assert_same_release(demo["embedded"], result.release_dir, "beam")


def test_beam_embedded_and_spark_agree_on_csv_input(case, tmp_path):
    """The three engines on one CSV input (text values, a dirty row, a null unit): one release."""
    pytest.importorskip("pyspark")
    rows = {"pid": ["1", "2", "3", "", "5", "5"], "geo": ["01001000100", "02005000100", "x", "01003000100",
                                                         "02005000300", "02005000300"],
            "age": ["10", "40", "abc", "70", "5", "6"], "sex": ["F", "M", "F", "M", "F", "F"]}
    spec_path = case(input={"path": "input.csv"})
    pacsv.write_csv(__import__("pyarrow").table(rows), spec_path.parent / "input.csv")
    releases = {}
    for engine in ("embedded", "beam", "spark"):
        releases[engine] = run_release(spec_path, engine=engine, key_file=tmp_path / "k.key", out_dir=tmp_path / engine,
                                       master="local[2]" if engine == "spark" else None,
                                       beam_options=DIRECT if engine == "beam" else None).release_dir
    assert_same_release(releases["embedded"], releases["beam"], "beam")
    assert_same_release(releases["embedded"], releases["spark"], "spark")


def test_empty_input_releases_every_public_cell(case, tmp_path):
    spec_path = case(rows={"pid": [1], "geo": ["not-a-tract"], "age": [10], "sex": ["F"]},
                     columns={"geo": {"type": "geography", "domain_file": "geo.txt", "on_invalid": "drop",
                                      "levels": {"state": 2, "county": 5, "tract": 11}},
                              "age": {"type": "integer", "min": 0, "max": 99, "bins": [0, 18, 65, 100]},
                              "sex": {"type": "categorical", "values": ["F", "M"]}})
    embedded = run_release(spec_path, key_file=tmp_path / "k.key", out_dir=tmp_path / "e")
    beamed = run_release(spec_path, key_file=tmp_path / "k.key", out_dir=tmp_path / "b", engine="beam",
                         beam_options=DIRECT)
    assert_same_release(embedded.release_dir, beamed.release_dir, "beam")
    assert pq.read_table(beamed.release_dir / "measurements" / "pop.tract.parquet").num_rows == 6


def test_records_as_units_need_no_bounding_step(case, tmp_path):
    spec_path = case(privacy_unit=None)
    embedded = run_release(spec_path, key_file=tmp_path / "k.key", out_dir=tmp_path / "e")
    beamed = run_release(spec_path, key_file=tmp_path / "k.key", out_dir=tmp_path / "b", engine="beam",
                         beam_options=DIRECT)
    assert_same_release(embedded.release_dir, beamed.release_dir, "beam")


def test_a_failed_noise_bundle_is_retried_without_changing_the_release(demo, tmp_path, monkeypatch):
    markers = tmp_path / "attempts"
    markers.mkdir()
    monkeypatch.setenv("DPRELEASE_TEST_FAIL_FIRST_ATTEMPT", f"noise:{markers}")
    with pytest.raises(DPReleaseError, match="Beam pipeline failed"):  # the portable DirectRunner does not retry
        run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=tmp_path / "no-retry", key_file=demo["key"],
                    engine="beam", beam_options=DIRECT)
    assert not (tmp_path / "no-retry" / "demo-2026").exists()
    for marker in markers.iterdir():
        marker.unlink()
    retried = run_release(DEMO_SPEC, input_path=str(demo["data"]), out_dir=tmp_path / "retried", key_file=demo["key"],
                          engine="beam", runner="BundleBasedDirectRunner")
    assert len(list(markers.iterdir())) >= 10  # every noise range was in a bundle that failed once
    assert_same_release(demo["embedded"], retried.release_dir, "beam")


def test_cli_post_processes_and_writes_parts_in_the_workers(demo, tmp_path):
    """From the CLI, small groups and parts: the Beam workers post-process and write every part; the release
    equals the embedded engine's with the same layout, and `dprelease verify` accepts it."""
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                              capture_output=True, text=True)

    common = ["--no-ledger", "--input", demo["data"], "--key-file", demo["key"], "--group-work", "64",
              "--part-rows", "64"]
    embedded = cli("run", DEMO_SPEC, *common, "--out", tmp_path / "embedded")
    beamed = cli("run", DEMO_SPEC, *common, "--engine", "beam", "--max-cells", 1000, "--out", tmp_path / "beam",
                 "--", *DIRECT)  # the cap is the driver's: no cell reaches it on this path
    assert embedded.returncode == 0 and beamed.returncode == 0, embedded.stderr + beamed.stderr
    assert "post-process, write" in beamed.stderr  # the workers' path, stated in the progress line
    release = tmp_path / "beam" / "demo-2026"
    assert len(list(release.glob("tables/*/part-*.parquet"))) > 10
    assert_same_release(tmp_path / "embedded" / "demo-2026", release, "beam")
    verified = cli("verify", release)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_ptransforms_compose_in_a_users_own_pipeline(demo, tmp_path):
    """A Beam user builds one table with the exposed transforms; it equals the engine's measurement."""
    from apache_beam.testing.util import assert_that

    from dprelease.transforms.beam import AddNoise, BoundContributions, EncodeRecords, Hierarchy, ReadInputBatches
    from dprelease.pipelines.run import bind_release_key
    from dprelease.pipelines.source import open_input
    from dprelease.transforms.csprng import ReleaseKey

    spec, base = load_spec(DEMO_SPEC)
    plan = build_plan(spec, base)
    source = open_input(plan, base, str(demo["data"]))
    key, _ = bind_release_key(ReleaseKey.load(demo["key"]), plan, source)
    hierarchy = next(q.name for q in spec.queries if q.kind == "hierarchy")
    tables = [t.name for t in plan.tables if t.query == hierarchy]
    expected = {name: pq.read_table(demo["embedded"] / "measurements" / f"{name}.parquet").column("noisy_count")
                for name in tables}

    def matches(results):
        assert sorted(name for name, _, _ in results) == sorted(tables)
        for name, start, values in results:
            assert start == 0 and np.array_equal(values, expected[name].to_numpy()), name

    with beam.Pipeline(options=pipeline_options(None, DIRECT)) as pipeline:
        noisy = (pipeline | beam.Create(source.read_tasks(3))
                 | ReadInputBatches(source.reader())
                 | EncodeRecords.from_plan(plan)
                 | BoundContributions.from_plan(plan, key, shards=3)
                 | Hierarchy(plan, hierarchy)
                 | AddNoise.from_plan(plan, key, names=tables))
        assert_that(noisy, matches)


def test_bound_contributions_without_a_privacy_unit(case, tmp_path):
    """privacy_unit: null: every record is its own unit; BoundContributions passes the records through (it once
    failed with KeyError '__unit__'), and the pipeline's noisy counts equal the embedded engine's."""
    from apache_beam.testing.util import assert_that

    from dprelease.pipelines.run import bind_release_key
    from dprelease.pipelines.source import open_input
    from dprelease.transforms.beam import AddNoise, BoundContributions, EncodeRecords, Histogram, ReadInputBatches
    from dprelease.transforms.csprng import ReleaseKey

    spec_path = case(privacy_unit=None)
    released = run_release(spec_path, key_file=tmp_path / "k.key")
    spec, base = load_spec(spec_path)
    plan = build_plan(spec, base)
    source = open_input(plan, base)
    key, _ = bind_release_key(ReleaseKey.load(tmp_path / "k.key"), plan, source)
    expected = pq.read_table(released.release_dir / "measurements" / "by_sex.parquet").column("noisy_count").to_numpy()
    with pytest.raises(ValueError, match="k must be 1"):
        BoundContributions(2, b"k" * 32, {"sex": 3}, unit=False)

    def matches(results):
        (name, start, values), = results
        assert name == "by_sex" and start == 0 and np.array_equal(values, expected)

    with beam.Pipeline(options=pipeline_options(None, ["--direct_running_mode=in_memory"])) as pipeline:
        noisy = (pipeline | beam.Create(source.read_tasks())
                 | ReadInputBatches(source.reader())
                 | EncodeRecords.from_plan(plan)
                 | BoundContributions.from_plan(plan, key)
                 | Histogram(plan, "by_sex")
                 | AddNoise.from_plan(plan, key, names=["by_sex"]))
        assert_that(noisy, matches)


def test_published_tables_composite_equals_the_launchers_release(case, tmp_path, monkeypatch):
    """`PublishedTables`: records in (dicts here, Arrow alike), every post-processed table out. Its key is drawn
    when the pipeline runs: with that draw fixed to the launcher's key (bound alike), its tables equal the
    published files of `dprelease run` (counts with gls_variance, a sum, a mean)."""
    from apache_beam.testing.util import assert_that

    from dprelease.pipelines import run as run_module
    from dprelease.pipelines.api import Release
    from dprelease.transforms import beam_release
    from dprelease.transforms.csprng import ReleaseKey

    from .test_api import persons, spec_with_means
    from .conftest import write_case

    frame = persons(300)
    spec_path = write_case(tmp_path / "case", spec_with_means(), rows={c: frame[c].tolist() for c in frame.columns})
    release = Release.from_yaml(spec_path)
    plan = release.build_plan()
    fixed = ReleaseKey(b"\x07" * 32)
    monkeypatch.setattr(run_module, "bind_release_key",
                        lambda key, plan_, source: (beam_release._bound(plan_, fixed, beam_release.PIPELINE_INPUT),
                                                    source.fingerprint(key)))
    released = run_release(spec_path, key_file=tmp_path / "k.key")
    names = [t.name for t in plan.tables] + [m.name for m in plan.means]
    expected = {name: pq.read_table(released.release_dir / "tables" / f"{name}.parquet") for name in names}

    def equal_to_the_files(results):
        assert sorted(name for name, _ in results) == sorted(names)
        for name, table in results:
            assert table.equals(expected[name]), name

    monkeypatch.setattr(beam_release.ReleaseKey, "generate", classmethod(lambda cls: fixed))
    with beam.Pipeline(options=pipeline_options(None, ["--direct_running_mode=in_memory"])) as pipeline:
        out = pipeline | beam.Create(frame.to_dict("records")) | PublishedTablesOf(release)
        assert_that(out, equal_to_the_files)
    with pytest.raises(SpecError, match="cells"):
        beam_release.PublishedTables(plan, max_cells=10)


def PublishedTablesOf(release):
    from dprelease.transforms.beam_release import PublishedTables

    return PublishedTables.from_spec(release)


def test_one_pipeline_run_twice_draws_independent_noise(case, tmp_path, monkeypatch):
    """Issue 29 item 1: the composite's key is drawn per execution, never when the graph is built. One pipeline
    object, built once and run twice over two inputs that differ in one record, publishes two draws whose
    difference is not the exact difference of the inputs (the reproduction: 500 -> 501 published as 501 -> 502)."""
    from dprelease.pipelines.api import Release
    from dprelease.transforms import beam_release

    drawn = []
    generate = beam_release.ReleaseKey.generate.__func__
    monkeypatch.setattr(beam_release.ReleaseKey, "generate",
                        classmethod(lambda cls: drawn.append(generate(cls)) or drawn[-1]))
    spec_path = case(privacy_unit=None, queries=[{"name": "cells", "kind": "histogram", "by": ["age", "sex"]}])
    source, label = tmp_path / "records.json", tmp_path / "label"

    def keep(element, directory=tmp_path):  # the pipeline's own copy of this function writes where the test reads
        name = (directory / "label").read_text()
        (directory / f"{name}.json").write_text(json.dumps(element[1].column("count").to_pylist()))

    pipeline = beam.Pipeline(options=pipeline_options(None, ["--direct_running_mode=in_memory"]))
    _ = (pipeline | beam.Create([str(source)]) | beam.FlatMap(lambda path: json.loads(Path(path).read_text()))
         | beam_release.PublishedTables.from_spec(Release.from_yaml(spec_path)) | beam.Map(keep))
    assert drawn == []  # building the graph draws nothing: no key can be in it
    for females in (500, 501):
        source.write_text(json.dumps([{"sex": "F", "age": 30}] * females + [{"sex": "M", "age": 30}] * 300))
        label.write_text(str(females))
        pipeline.run().wait_until_finish()
    assert len(drawn) == 2  # one key per execution
    first, second = (json.loads((tmp_path / f"{n}.json").read_text()) for n in (500, 501))
    exact = [b - a for a, b in zip(first, second)]
    assert sorted(exact) != [0] * (len(exact) - 1) + [1], exact  # not the exact difference of the inputs


def test_the_documented_beam_example_runs(case, tmp_path):
    """examples/beam_release.py (deploy/beam/README.md) publishes every table of the spec."""
    from .conftest import REPO

    spec_path = case(privacy_unit=None)
    done = subprocess.run([sys.executable, str(REPO / "examples" / "beam_release.py"), str(spec_path),
                           str(spec_path.parent / "input.parquet"), str(tmp_path / "tables")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = sorted(p.stem for p in (tmp_path / "tables").glob("*.parquet"))
    assert "pop.tract" in written and "by_sex" in written
    assert pq.read_table(tmp_path / "tables" / "pop.nation.parquet").column("count")[0].as_py() >= 0


def test_runner_options_are_built_and_checked():
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

    direct = pipeline_options(None, [], workers=3)
    assert direct.view_as(StandardOptions).runner == "DirectRunner"
    assert direct.view_as(DirectOptions).direct_running_mode == "multi_processing"
    assert direct.view_as(DirectOptions).direct_num_workers == 3
    mine = pipeline_options(None, ["--direct_running_mode=in_memory"], workers=3)
    assert mine.view_as(DirectOptions).direct_running_mode == "in_memory"
    flink = pipeline_options("FlinkRunner", ["--flink_master=localhost:8081", "--parallelism=8"])
    flags = flink.get_all_options(drop_default=True, retain_unknown_options=True)
    assert flags["runner"] == "FlinkRunner" and flags["flink_master"] == "localhost:8081" and flags["parallelism"] == 8
    spark = pipeline_options(None, ["--runner=SparkRunner", "--spark_master_url=spark://127.0.0.1:7077"])
    assert spark.view_as(StandardOptions).runner == "SparkRunner"
    with pytest.raises(SpecError, match="--project, --region, --temp_location"):
        pipeline_options("DataflowRunner", [])
    dataflow = pipeline_options("DataflowRunner", ["--project=p", "--region=europe-west1", "--temp_location=gs://b/t"])
    assert PipelineOptions.from_dictionary(dataflow.get_all_options()).view_as(StandardOptions).runner == "DataflowRunner"
    with pytest.raises(SpecError, match="give one"):
        pipeline_options("FlinkRunner", ["--runner=SparkRunner"])
    with pytest.raises(SpecError, match="allowed"):
        pipeline_options("NoSuchRunner", [])
    from apache_beam.options.pipeline_options import DebugOptions

    assert "disable_always_on_exception_sampling" in direct.view_as(DebugOptions).experiments
    assert "disable_always_on_exception_sampling" in dataflow.view_as(DebugOptions).experiments
    for sampled in (["--experiments=enable_data_sampling"], ["--experiments=a,enable_always_on_exception_sampling"],
                    ["--dataflow_service_options=enable_always_on_exception_sampling"],
                    ["--experiments= ENABLE_DATA_SAMPLING"]):
        with pytest.raises(SpecError, match="never samples"):  # the runner would receive records
            pipeline_options(None, sampled)


def test_cli_runs_beam_and_rejects_misplaced_options(case, tmp_path):
    spec_path = case()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                              capture_output=True, text=True)

    ran = cli("run", spec_path, "--no-ledger", "--engine", "beam", "--out", tmp_path / "out", "--",
              "--direct_num_workers=2")
    assert ran.returncode == 0, ran.stderr
    assert cli("verify", tmp_path / "out" / "test-release").returncode == 0
    wrong = cli("run", spec_path, "--no-ledger", "--engine", "embedded", "--runner", "FlinkRunner")
    assert wrong.returncode == 2 and "only the beam engine" in wrong.stderr
    no_project = cli("run", spec_path, "--no-ledger", "--engine", "beam", "--runner", "DataflowRunner")
    assert no_project.returncode == 2 and "--project" in no_project.stderr


def test_input_validation_runs_in_the_beam_workers(case, tmp_path):
    """The value-level suite runs per batch in the workers and counts what the pandas path counts."""
    pytest.importorskip("great_expectations")
    from .test_validation import DIRTY, internal_report

    spec_path = case(rows=DIRTY)
    reports = {}
    for engine in ("embedded", "beam"):
        run_release(spec_path, engine=engine, beam_options=DIRECT if engine == "beam" else None,
                    out_dir=tmp_path / engine, key_file=tmp_path / "k.key", internal_dir=tmp_path / f"{engine}-internal")
        reports[engine] = internal_report(tmp_path / f"{engine}-internal")
    assert reports["beam"]["engine"] == "beam" and reports["beam"]["success"] is False
    counts = {e: [(x["type"], x["kwargs"]["column"], x.get("unexpected_count"), x.get("sample_unexpected"))
                  for x in r["expectations"]] for e, r in reports.items()}
    assert counts["beam"] == counts["embedded"]


def test_candidates_are_scored_over_every_range_and_a_missing_range_is_refused():
    """ScoreCandidates sums a candidate's range scores in the workers and counts the ranges (empty ones
    included): the score is the whole table's `pair_score` and the count the public number of ranges; the
    driver refuses a score made of fewer ranges, or none."""
    from apache_beam.testing.util import assert_that

    from dprelease.pipelines.engines.base import checked_scores
    from dprelease.transforms.beam import ScoreCandidates
    from dprelease.transforms.mst import CliqueEstimate, independent_estimates, pair_estimate, pair_score
    from dprelease.transforms.release_values import TableRelease

    rng = np.random.default_rng(9)
    units, a, b = 3, 4, 5
    counts = rng.integers(0, 9, size=units * a * b) * (rng.random(units * a * b) < 0.4)
    counts[20:40] = 0  # a whole range without records: still scored
    totals, (share_a, share_b) = independent_estimates([rng.integers(-3, 30, size=(units, n)) for n in (a, b)])
    release = TableRelease("m.x-y", counts.size, None)
    scorer = ScoreCandidates({"m.x-y": release}, {"m.x-y": CliqueEstimate.pair(totals, share_a, share_b)}, range_cells=20)
    expected = pair_score(counts.reshape(units, a, b), pair_estimate(totals, share_a, share_b))
    assert scorer.expected_ranges() == {"m.x-y": 3}
    cells = np.flatnonzero(counts)

    def matches(results):
        assert results == [("m.x-y", (expected, 3))]

    with beam.Pipeline(options=pipeline_options(None, DIRECT)) as pipeline:
        scored = pipeline | beam.Create([("m.x-y", (cells, counts[cells]))]) | scorer
        assert_that(scored, matches)
    what = "the Beam selection pipeline"
    assert checked_scores({"m.x-y": (expected, 3)}, {"m.x-y": 3}, what) == {"m.x-y": expected}
    for found in ({"m.x-y": (expected, 2)}, {}):
        with pytest.raises(DPReleaseError, match=r"table m.x-y: the Beam selection pipeline scored [02] of its 3 ranges"):
            checked_scores(found, {"m.x-y": 3}, what)


def test_a_selection_keeps_its_records_in_a_store_temp_location_and_leaves_nothing_there(tmp_path, s3, credentials):
    """With --temp_location on an object store (a real S3-compatible server on 127.0.0.1), a `select: mst` run
    keeps its bounded records, key files, noisy ranges and scores there and removes every object at the end (Beam
    deletes a prefix only when its name ends in '/': without it nothing was removed). The directory of a launcher
    killed on this host is removed first (found by review: a SIGKILLed launcher's key files stayed for good); a live
    one's and another host's are left."""
    import pyarrow.fs as pafs

    from .test_mst import mst_case

    from dprelease.pipelines.housekeeping import host_identity, store_leftover_tag

    store = pafs.S3FileSystem(endpoint_override=s3, scheme="http", allow_bucket_creation=True)
    store.create_dir("beam-temp")
    dead = f"beam-temp/t/dprelease-beam+4194303.1+{host_identity()}+0a1b"      # a SIGKILLed launcher's, on this host
    live = f"beam-temp/t/dprelease-beam+{store_leftover_tag()}0c0d"             # this process's: alive
    elsewhere = "beam-temp/t/dprelease-beam+4194303.1+another-host~1~1+0e0f"   # cannot be told dead here
    for directory in (dead, live, elsewhere):
        for name in ("key-0", "ranges/00000.npy"):
            with store.open_output_stream(f"{directory}/{name}") as handle:
                handle.write(b"left by a run")
    path = mst_case(tmp_path / "c", budget={"definition": "zcdp", "rho": "1/2", "delta": 1e-9})
    result = run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "out", engine="beam",
                         beam_options=["--direct_running_mode=in_memory", "--temp_location=s3://beam-temp/t",
                                       f"--s3_endpoint_url=http://{s3}"])
    assert (result.release_dir / "manifest.json").exists()
    left = store.get_file_info(pafs.FileSelector("beam-temp", recursive=True))
    assert sorted(info.path for info in left if info.type == pafs.FileType.File) == sorted(
        f"{directory}/{name}" for directory in (live, elsewhere) for name in ("key-0", "ranges/00000.npy"))


@pytest.mark.parametrize("temp", ["s3://b/t/../release", "s3://b//t", "s3://b/%2e%2e/t", "s3://user:secret@b/t",
                                  "s3://b/t?secret_key=x", "gs://b/./t"])
def test_a_store_temp_location_that_is_not_plain_or_holds_credentials_is_refused(case, tmp_path, temp):
    """Found by review: a store --temp_location was used as given, so `..` could put the run's key files inside a
    release and user info or a query could carry a secret into recorded options. Refused before anything runs."""
    with pytest.raises(SpecError, match="--temp_location"):
        run_release(case(), key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "out", engine="beam",
                    beam_options=["--direct_running_mode=in_memory", f"--temp_location={temp}"])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_kept_records_the_launcher_cannot_see_stop_the_selection(tmp_path, monkeypatch):
    """Found by review: workers whose --temp_location is not the launcher's storage keep their records where the
    launcher lists none, and every pass would count zero records. The keep pipeline counts the files it wrote; a
    launcher that finds another number stops before any pass (here the listing is made to miss them)."""
    from dprelease.transforms import beam as transforms

    from .test_mst import mst_case

    monkeypatch.setattr(transforms, "KEPT_PATTERN", "not-the-kept-files-*.arrow")
    path = mst_case(tmp_path / "c", budget={"definition": "zcdp", "rho": "1/2", "delta": 1e-9})
    with pytest.raises(DPReleaseError, match="storage that the workers and the launcher share"):
        run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "out", engine="beam",
                    beam_options=["--direct_running_mode=in_memory"])


def test_a_bad_temp_location_is_refused_before_the_selection_is_charged(tmp_path):
    """Found by review: the store --temp_location was first checked when the first pipeline started, after a
    selection's charge (never refunded): the run failed charged, publishing nothing. It is checked when the engine
    is made now, before any key, budget or data."""
    from fractions import Fraction

    from dprelease.accounting.ledger import history, open_ledger, set_budget

    from .test_mst import mst_case

    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "rho", Fraction(100))
    path = mst_case(tmp_path / "c", budget={"definition": "zcdp", "rho": "1/2", "delta": 1e-9})
    with pytest.raises(SpecError, match="--temp_location"):
        run_release(path, key_file=tmp_path / "k.key", ledger=book, out_dir=tmp_path / "out", engine="beam",
                    beam_options=["--direct_running_mode=in_memory", "--temp_location=s3://b/t/../release"])
    assert history(open_ledger(book), "test-data")[1] == [] and not (tmp_path / "k.key").exists()


def test_a_temp_location_inside_a_published_release_is_refused(case, tmp_path, s3, credentials):
    """Found by review: a plain store --temp_location inside a published release was accepted, and the run's key
    files, noisy values and kept records would have been written among its files (a local one was refused only
    after a selection's charge). Refused when the engine is made, in a store and on disk; so is a store location
    inside the run's own release prefix."""
    import pyarrow.fs as pafs

    store = pafs.S3FileSystem(endpoint_override=s3, scheme="http", allow_bucket_creation=True)
    store.create_dir("pub")
    with store.open_output_stream("pub/releases/2026-10/manifest.json") as handle:
        handle.write(b"{}")
    published = tmp_path / "published"
    published.mkdir()
    (published / "manifest.json").write_text("{}")
    out = f"s3://pub/out?endpoint_override={s3}&scheme=http"
    for temp, out_dir in (("s3://pub/releases/2026-10/t", tmp_path / "out"), (str(published / "t"), tmp_path / "out"),
                          ("s3://pub/out/test-release/t", out)):
        with pytest.raises(SpecError, match="--temp_location.*inside the release"):
            run_release(case(), key_file=tmp_path / "k.key", ledger=None, out_dir=out_dir, engine="beam",
                        beam_options=["--direct_running_mode=in_memory", f"--temp_location={temp}",
                                      f"--s3_endpoint_url=http://{s3}"])
    assert not (tmp_path / "k.key").exists()


@pytest.mark.parametrize("as_uri", [False, True])
def test_a_local_temp_location_keeps_nothing_and_loses_what_killed_runs_left(case, tmp_path, monkeypatch, as_uri):
    """Found by review: result directories under a local --temp_location were named by a random id only, so a
    SIGKILLed run's key file and noisy ranges stayed there for good. They are named after the process now, and a
    run removes those of dead runs on this host (never a live one's). A file:// location is the same local path
    (it was read as a relative directory named 'file:')."""
    import os

    from dprelease.pipelines.housekeeping import host_identity, leftover_tag

    temp = tmp_path / "temp"
    temp.mkdir(mode=0o700)
    dead = temp / f"dprelease-beam@4194303.1@{host_identity()}@0a1b"
    live = temp / f"dprelease-beam@{leftover_tag()}ffff"  # this process's: alive
    for directory in (dead, live):
        directory.mkdir(mode=0o700)
        (directory / "key-0").write_bytes(os.urandom(32))
    monkeypatch.chdir(tmp_path)
    run_release(case(), key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "out", engine="beam",
                beam_options=["--direct_running_mode=in_memory",
                              f"--temp_location={temp.as_uri() if as_uri else temp}"])
    assert sorted(p.name for p in temp.iterdir()) == [live.name]
    assert not (tmp_path / "file:").exists()


def _sdk_workers(pid: int) -> list[int]:
    """Processes running Beam's SDK worker that `pid` started (directly or through a shell), from /proc."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
                commands[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier and child not in found}
        found |= frontier
    return sorted(child for child in found if b"sdk_worker_main" in commands.get(child, b""))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_signalled_beam_run_ends_and_leaves_no_sdk_worker(demo, tmp_path, signum):
    """Found by review: a SIGTERM to a Beam run hung it for good (Beam's own clean-up joined SDK workers that never
    exit, and later SIGTERMs were ignored); after a SIGKILL of the run, its SDK workers (holding records) lived on,
    re-parented. Now a SIGTERM kills them first (the run exits 143, its reservation aborted), and a watch process
    kills them when the run dies however it dies."""
    from .test_confidential import _alive, _wait_for

    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux)")
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "demo-census", "rho", Fraction(10))
    process = subprocess.Popen([sys.executable, "-m", "dprelease.pipelines.cli", "run", str(DEMO_SPEC), "--input",
                                str(demo["data"]), "--ledger", str(book), "--key-file", str(tmp_path / "k.key"),
                                "--out", str(tmp_path / "out"), "--engine", "beam", "--", *DIRECT],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _wait_for(lambda: len(_sdk_workers(process.pid)) >= 2, timeout=120), "no SDK worker started"
        workers = _sdk_workers(process.pid)
        process.send_signal(signum)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # hung: leave nothing running behind the failure
            for pid in _sdk_workers(process.pid) + [process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
    assert process.returncode in (-signum, 128 + signum)
    assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=10), "an SDK worker outlived the run"
    if signum == signal.SIGTERM:
        assert [r.status for r in history(open_ledger(book), "demo-census")[1]] == [ABORTED]
        assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


WATCHED = """
import json, os, subprocess, sys, time
from dprelease.pipelines.engines.beam import _launching_workers, _run_token, pipeline_options
from dprelease.pipelines.engines.launcher_watch import run_mark
options = pipeline_options(None, [], 2)
token = _run_token(options)
assert token != _run_token(pipeline_options(None, [], 2))  # each run its own
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
with _launching_workers(options):
    marked = subprocess.Popen(sleeper, env=dict(os.environ, PIPELINE_OPTIONS=json.dumps({"experiments": [run_mark(token)]})))
    other = subprocess.Popen(sleeper)  # started by the host during the run, not the runner's
    print(marked.pid, other.pid, flush=True)
    time.sleep(60)
"""


def test_the_watch_kills_only_the_runs_marked_workers_when_the_launcher_is_killed():
    """Found by review: the workers were marked through the process's environment, so every process any thread
    started during a Beam run was killed at its end, and two runs in one process killed each other's workers. Now a
    run's token travels in its pipeline options only (the runner gives them to its SDK workers): after a SIGKILL of
    the launcher, the watch kills the processes carrying that token and no other."""
    from .test_confidential import _alive, _wait_for

    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux)")
    launcher = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True)
    marked, other = (int(pid) for pid in launcher.stdout.readline().split())
    try:
        launcher.kill()
        launcher.wait()
        assert _wait_for(lambda: not _alive(marked), timeout=10), "the run's marked worker outlived its launcher"
        assert _alive(other), "a process the run did not mark was killed"
    finally:
        for pid in (marked, other):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sparse_counts_are_summed_exactly_however_they_are_combined(monkeypatch):
    """A table's sparse counts summed by the combine (inputs gathered and summed in batches, accumulators merged)
    and by `dense_parts` (a range's parts, distinct ascending cells or repeated in any order): every cell's exact
    int64 sum, counts past 2^53 included (a float64 sum rounds them)."""
    from dprelease.transforms import beam as beam_transforms
    from dprelease.transforms.release_values import dense_parts

    monkeypatch.setattr(beam_transforms, "COMPACT_ENTRIES", 50)
    rng = np.random.default_rng(8)
    parts = []
    for i in range(40):
        cells = np.unique(rng.integers(0, 300, rng.integers(0, 60)))
        parts.append((cells, rng.integers(0, 2**55, cells.size) + (2**53 if i % 3 == 0 else 0)))
    expected = {}
    for cells, counts in parts:
        for cell, count in zip(cells.tolist(), counts.tolist()):
            expected[cell] = expected.get(cell, 0) + count
    combine = beam_transforms._SumSparseCounts()
    accumulators = []
    for chunk in (parts[:13], parts[13:14], parts[14:]):
        accumulator = combine.create_accumulator()
        for part in chunk:
            accumulator = combine.add_input(accumulator, part)
        accumulators.append(accumulator)
    cells, counts = combine.extract_output(combine.merge_accumulators(accumulators))
    assert cells.tolist() == sorted(expected) and counts.tolist() == [expected[c] for c in sorted(expected)]
    many = combine.create_accumulator()
    for _ in range(100_000):  # small and empty parts: summed as they come, not gathered (nor shuffled) raw
        many = combine.add_input(many, (np.arange(1), np.ones(1, np.int64)))
        many = combine.add_input(many, (np.empty(0, np.int64), np.empty(0, np.int64)))
    assert len(many[0]) <= beam_transforms.COMPACT_PAIRS + 1
    assert len(combine.get_accumulator_coder().encode(combine.compact(many))) < 2000
    assert [v.tolist() for v in combine.extract_output(many)] == [[0], [100_000]]
    lone = combine.add_input(combine.create_accumulator(), (np.array([5, 1, 5]), np.array([1, 2, 3], np.int32)))
    assert [v.tolist() for v in combine.extract_output(lone)] == [[1, 5], [2, 4]]
    repeated = [(np.concatenate([c[::-1], c[:3]]), np.concatenate([n[::-1], n[:3]])) for c, n in parts[:5]]
    for given in (parts, repeated):
        sums = {}
        for cells, counts in given:
            for cell, count in zip(cells.tolist(), counts.tolist()):
                sums[cell] = sums.get(cell, 0) + count
        dense = dense_parts(100, 250, [(c[(c >= 100) & (c < 250)], n[(c >= 100) & (c < 250)]) for c, n in given])
        assert dense.tolist() == [sums.get(cell, 0) for cell in range(100, 250)]


def test_a_shard_piece_crosses_the_shuffle_unchanged():
    """Shard pieces travel as zstd-compressed Arrow IPC streams: every code type and unit kind, and an empty
    piece, come back equal (schema included)."""
    import pyarrow as pa

    from dprelease.transforms.bound import shuffled, unshuffled

    pieces = [pa.table({"a": pa.array([1, 2, 3], pa.int8()), "g": pa.array([7, 0, 44626], pa.int32()),
                        "__unit__": pa.array([b"x", b"\xff", b""], pa.large_binary())}),
              pa.table({"m": pa.array([0, 500001], pa.int32()), "__unit__": pa.array([2**63 - 1, -1], pa.int64())}),
              pa.table({"a": pa.array([], pa.int8()), "__unit__": pa.array([], pa.uint64())})]
    for piece in pieces:
        data = shuffled(piece)
        assert isinstance(data, bytes) and unshuffled(data).equals(piece, check_metadata=True)

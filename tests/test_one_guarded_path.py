"""Issue 29 ("One guarded path"), item by item: each test reproduces a defect found on main a53fb5b and shows it
closed at its root. Item 1 is `test_beam.test_one_pipeline_run_twice_draws_independent_noise`, items 7-9
`test_hostile_inputs` (secrets), and the classes of items 10-14 and 18 also run for every entry point in
`test_hostile_surface`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dprelease
from dprelease.accounting.ledger import COMMITTED, open_ledger, set_budget
from dprelease.pipelines import run as run_module
from dprelease.pipelines.commands import verify
from dprelease.pipelines.run import run_release

from .conftest import small_spec, write_case
from .test_api import persons
from .test_key_reuse import statuses
from .test_mst import ATTRIBUTES, mst_case
from .test_storage import credentials, parquet_bytes, s3, upload  # noqa: F401 - fixtures

boto3 = pytest.importorskip("boto3")


def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)], capture_output=True,
                          text=True, **kwargs)


def raw_put(endpoint: str, bucket: str, key: str, data: bytes) -> None:
    """An object under exactly `key` (pyarrow normalises `a/../b` away when it writes; S3 keeps such keys)."""
    boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1").put_object(
        Bucket=bucket, Key=key, Body=data)


# ---- 2. object keys with `..` are never read twice, nor from outside the prefix --------------------------------------

@pytest.mark.parametrize("odd", ["alias/../alias/a.parquet", "in6/../in/persons.parquet"])
def test_an_object_key_with_dot_dot_is_refused_before_anything_is_read(s3, credentials, tmp_path, odd):
    """Main normalised `alias/../alias/a.parquet` to `alias/a.parquet`, fingerprinted and counted it twice (nation
    39,999 for 20,000 records), and released data outside `in6/` through `in6/../in/persons.parquet`."""
    prefix = odd.split("/", 1)[0]
    upload(s3, "dots", {f"{prefix}/a.parquet": parquet_bytes(persons(200)), "in/persons.parquet":
                        parquet_bytes(persons(200))})
    raw_put(s3, "dots", odd, parquet_bytes(persons(200)))
    spec = write_case(tmp_path, small_spec())
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out",
              "--input", f"s3://dots/{prefix}/?endpoint_override={s3}&scheme=http")
    assert ran.returncode == 2 and odd.split("/", 1)[1] in ran.stderr and "not plain" in ran.stderr, ran.stderr
    assert not (tmp_path / "k.key").exists() and not (tmp_path / "out").exists()


# ---- 3. the key is bound to the bytes the engine counts --------------------------------------------------------------

def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Same size, modification time put back (what `os.utime` allows any writer)."""
    before = os.stat(path)
    assert len(data) == before.st_size
    with open(path, "r+b") as handle:
        handle.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _same_size_pair(table: pa.Table) -> tuple[bytes, bytes]:
    """(the table, the table with one sex flipped) as Parquet files of one size (padded in key-value metadata)."""
    def written(t: pa.Table, pad: int) -> bytes:
        sink = pa.BufferOutputStream()
        pq.write_table(t.replace_schema_metadata({"pad": "x" * pad}), sink)
        return sink.getvalue().to_pybytes()

    sexes = table.column("sex").to_pylist()
    sexes[0] = "M" if sexes[0] == "F" else "F"
    changed = table.set_column(table.schema.get_field_index("sex"), "sex", pa.array(sexes))
    original = written(table, 1000)
    same = next(data for data in (written(changed, pad) for pad in range(0, 2000)) if len(data) == len(original))
    return original, same


@pytest.mark.parametrize("engine", ["embedded", "embedded-workers", "beam"])
def test_a_file_rewritten_in_place_during_a_run_is_never_counted(case, tmp_path, monkeypatch, engine):
    """Main checked (size, mtime) between the fingerprint and the engine's read: a part file rewritten in place
    with its mtime restored was counted while the ledger bound the old fingerprint, so a free re-run over the old
    bytes published the exact difference. Now every read is of a private copy whose SHA-256 is the one taken
    with the fingerprint: the run stops, nothing is published or charged ('embedded-workers': the embedded
    engine's worker processes read a spilling input, and fail the same way)."""
    workers = None
    if engine == "embedded-workers":
        from dprelease.pipelines.engines import embedded

        monkeypatch.setattr(embedded, "PARTITION_BYTES", 16)
        engine, workers = "embedded", 2
    rows = {"pid": list(range(40)), "geo": ["01001000100"] * 40, "age": list(range(40)), "sex": ["F", "M"] * 20}
    spec = case(rows=rows)
    data = spec.parent / "input.parquet"
    original, changed = _same_size_pair(pq.read_table(data))
    data.write_bytes(original)
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    bind = run_module.bind_release_key

    def rewrite_after_binding(key, plan, source):
        bound = bind(key, plan, source)
        _rewrite_in_place(data, changed)
        return bound

    monkeypatch.setattr(run_module, "bind_release_key", rewrite_after_binding)
    with pytest.raises(dprelease.DPReleaseError, match="changed after the release key was bound"):
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out", engine=engine,
                    workers=workers)
    assert not (tmp_path / "out" / "test-release").exists() and statuses(book) == ["aborted"]
    monkeypatch.setattr(run_module, "bind_release_key", bind)
    _rewrite_in_place(data, original)
    assert run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out",
                       engine=engine, workers=workers).release_dir.is_dir()


# ---- 4. a free re-run must make the same selection -------------------------------------------------------------------

def test_a_free_rerun_that_chooses_other_tables_is_refused(tmp_path, monkeypatch):
    """Selections come from floating-point fits: a re-run on another machine could choose other tables and publish
    their measurements free. The ledger records the chosen tables; a re-run whose choice differs (forced here)
    publishes nothing (exit 3)."""
    from dprelease.pipelines import selection as selection_module

    spec = mst_case(tmp_path / "c")
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "rho", Fraction(100))
    first = run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out")
    published = (first.release_dir / "manifest.json").read_bytes()
    chosen = json.loads(published)["selections"][0]["chosen"]
    assert run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out2").key_reused

    def star(center: str) -> tuple:
        """The tree of every pair holding `center` (each pair in the query's order)."""
        return tuple(tuple(sorted((center, a), key=ATTRIBUTES.index)) for a in ATTRIBUTES if a != center)

    forced = next(tree for tree in (star(ATTRIBUTES[0]), star(ATTRIBUTES[1]))
                  if sorted(map(list, tree)) != sorted(chosen))
    monkeypatch.setattr(selection_module, "_choose", lambda plan, selection, candidates, scores, key: forced)
    with pytest.raises(dprelease.BudgetError, match="chose other tables"):
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "out3")
    assert not (tmp_path / "out3" / "test-release").exists()
    assert statuses(book) == [COMMITTED]


# ---- 5. workers write only where the driver can check and remove -----------------------------------------------------

def test_a_worker_that_cannot_see_the_drivers_staging_writes_nothing(tmp_path, monkeypatch):
    """Main's Spark executors resolved a relative --out in their own work directories and left noisy parts there
    after the job failed. Paths are resolved on the driver, and a worker writes a part only into the staging
    directory that holds its run's token: elsewhere (another disk, a path resolved otherwise) it writes nothing."""
    from dprelease.pipelines.dataflow import Flow, noise_piece, route_noise, run_local
    from dprelease.pipelines.layout import Layout
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.release import new_staging
    from dprelease.pipelines.spec import load_spec

    plan = build_plan(*load_spec(write_case(tmp_path / "c", small_spec())))
    staging, token = new_staging(tmp_path / "driver" / "r")
    elsewhere = tmp_path / "worker-disk" / staging.name  # the same path on a disk the driver does not share
    elsewhere.mkdir(parents=True)
    flow = Flow(plan, Layout(), str(elsewhere), staging_token=token)
    pieces = [noise_piece(flow, i, 0, np.zeros(t.n_outputs, dtype=np.int64)) for i, t in enumerate(plan.tables)]
    with pytest.raises(dprelease.DPReleaseError, match="nothing was written"):
        run_local(flow, pieces)
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(ValueError, match="relative"):
        from dprelease.pipelines.dataflow import run_token

        run_token(plan, Layout(), "relative/staging", token)
    monkeypatch.chdir(tmp_path)
    result = run_release(tmp_path / "c" / "spec.yaml", key_file=tmp_path / "k.key", out_dir="rel-out", ledger=None)
    assert Path(result.release_dir).is_absolute() and Path(result.release_dir) == tmp_path / "rel-out" / "test-release"
    assert route_noise  # the routed stages are what run_local ran above


# ---- 6. the loss per attribute and level includes the selection, and its worst case ---------------------------------

def test_the_loss_per_attribute_includes_the_selection_and_states_its_worst_case(tmp_path):
    """Main stated the loss of the tables that happened to be chosen: an attribute the tree did not pick showed
    only its 1-way table. Each attribute now carries the selection that read it, and the worst case over every
    selection the data could make (every chosen table holding it) is stated too, and recomputed by verify."""
    from dprelease.pipelines.verify import verify_release

    spec = mst_case(tmp_path / "c")
    root = run_release(spec, key_file=tmp_path / "k.key", ledger=None).release_dir
    manifest = json.loads((root / "manifest.json").read_text())
    [selection] = manifest["selections"]
    implied = manifest["implied_loss"]
    rho = {a: Fraction(v["rho"]["fraction"]) for a, v in implied["by_attribute"].items()}
    worst = {a: Fraction(v["rho"]["fraction"]) for a, v in implied["worst_case_over_selections"]["by_attribute"].items()}
    one_way = {t["name"].split(".")[1]: Fraction(t["loss"]["fraction"])
               for t in manifest["tables"] if t["query"] == "m" and len(t["dimensions"]) == 2}
    selection_rho = Fraction(selection["loss"]["fraction"])
    pair_rho = Fraction(selection["pair_tables"]["loss"]["fraction"])
    for attribute in ATTRIBUTES:
        in_chosen = sum(attribute in pair for pair in selection["chosen"])
        assert rho[attribute] == one_way[attribute] + selection_rho + in_chosen * pair_rho
        assert worst[attribute] == one_way[attribute] + selection_rho + 3 * pair_rho >= rho[attribute]
    assert any(worst[a] > rho[a] for a in ATTRIBUTES)  # a tree never holds every attribute in every pair
    level = implied["by_geography_level"]["geo.state"]["rho"]["fraction"]
    assert Fraction(level) >= selection_rho + 3 * pair_rho
    assert verify_release(root).ok
    manifest["implied_loss"]["worst_case_over_selections"]["by_attribute"]["age"]["rho"]["fraction"] = "0"
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert any("worst_case_over_selections" in p for p in verify_release(root).problems)


# ---- 11. every object under a release's prefix is a listed file or a mismatch ---------------------------------------

ODD_NAMES = ["../../../outside", "a//b", "./dot", "tables/x/../../y", "tables/pop.nation.csv/x", "notes/"]
"""Also a key ending in '/' that holds content (a store lists it as a directory, found by review)."""


def test_verify_by_uri_reports_every_odd_object_as_a_mismatch(s3, credentials, tmp_path):
    spec = write_case(tmp_path / "c", small_spec())
    uri = f"s3://oddnames/releases/?endpoint_override={s3}&scheme=http"
    upload(s3, "oddnames", {})
    run_release(spec, key_file=tmp_path / "k.key", out_dir=uri, ledger=None)
    assert verify(uri.replace("/?", "/test-release?")).ok
    for name in ODD_NAMES:
        raw_put(s3, "oddnames", f"releases/test-release/{name}", b"odd")
    report = verify(uri.replace("/?", "/test-release?"))
    assert not report.ok
    said = " ".join(report.problems)
    for name in ("outside", "a//b", "./dot", "x/../../y", "pop.nation.csv'", "pop.nation.csv/x", "notes"):
        assert name in said, (name, report.problems)  # a listed file that is also a prefix: both named
    raw_put(s3, "oddnames", "releases/test-release/manifest.json/x", b"odd")
    with pytest.raises(dprelease.DPReleaseError, match="which object is the manifest cannot be told"):
        verify(uri.replace("/?", "/test-release?"))


# ---- 15. sizes are Python integers: no wrap-around --------------------------------------------------------------------

def test_a_joint_of_two_to_the_sixty_fifth_cells_is_planned_as_it_is(tmp_path):
    """13 attributes of 32 values (and `(other)`): over 2^65 joint cells. Main multiplied in int64 and stated 0 joint cells per unit,
    then read the confidential input and died in post-processing (exit 1)."""
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.postprocessing import joint_size, marginals_path
    from dprelease.pipelines.spec import load_spec

    spec = small_spec(queries=[{"name": "wide", "kind": "marginals", "attributes": [f"a{i}" for i in range(13)],
                                "way": 1}])
    spec["columns"] = {f"a{i}": {"type": "integer", "min": 0, "max": 31} for i in range(13)}
    path = write_case(tmp_path, spec, rows={"pid": [1], **{f"a{i}": [0] for i in range(13)}})
    plan = build_plan(*load_spec(path))
    query = plan.query("wide")
    cells = plan.domains["a0"].size ** 13
    assert joint_size(plan, query) == cells > 2 ** 65
    assert marginals_path(plan, query) == "tables"  # over the per-unit limit: each table on its own
    planned = cli("plan", path)
    assert planned.returncode == 0 and f"{cells:,} joint cells per unit" in planned.stdout, planned.stdout
    assert run_release(path, key_file=tmp_path / "k.key", ledger=None).release_dir.is_dir()


# ---- 16. every output is checked before anything is reserved --------------------------------------------------------

def test_an_output_uri_with_dot_dot_is_refused_before_the_charge(s3, credentials, tmp_path):
    """Main reserved and charged, then noticed `s3://bkt/../other/` and reported leftovers that did not exist."""
    spec = write_case(tmp_path, small_spec())
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(10))
    ran = cli("run", spec, "--ledger", book, "--key-file", tmp_path / "k.key",
              "--out", f"s3://bkt/../other/?endpoint_override={s3}&scheme=http")
    assert ran.returncode == 2 and "not plain" in ran.stderr, ran.stderr
    assert statuses(book) == [] and not (tmp_path / "k.key").exists()


# ---- 17. API inputs: errors name the column; outcomes never depend on values ----------------------------------------

def _frame() -> pd.DataFrame:
    return persons(60)[["pid", "geo", "age", "sex"]]


@pytest.mark.parametrize("data, said", [
    (lambda: _frame()["sex"], "not a DataFrame"),
    (lambda: pd.concat([_frame(), _frame()[["sex"]]], axis=1), "repeated: ['sex']"),
    (lambda: _frame().assign(age=_frame()["age"] + 0j), "column 'age' holds complex numbers"),
])
def test_api_inputs_that_cannot_be_read_are_spec_errors_naming_the_column(case, tmp_path, data, said):
    with pytest.raises(dprelease.SpecError) as raised:
        dprelease.Release.from_yaml(case()).run(data(), ledger=None, key_file=tmp_path / "k.key")
    assert said in str(raised.value)


def test_sparse_and_mixed_categorical_columns_run_whatever_their_values(case, tmp_path):
    """A Categorical mixing text and integers failed with ArrowInvalid on main, so whether a run failed depended
    on confidential values; a SparseArray failed too. Both are read as any column."""
    frame = _frame()
    frame["age"] = pd.arrays.SparseArray(frame["age"].to_numpy())
    frame["sex"] = pd.Categorical(["F", 1] * 30)
    result = dprelease.Release.from_yaml(case()).run(frame, ledger=None, key_file=tmp_path / "k.key")
    assert result.table("by_sex") is not None


@pytest.mark.parametrize("option, value", [("workers", 260), ("workers", -5), ("workers", "3"), ("workers", 2.0),
                                           ("overwrite", "no"), ("strict", 1), ("max_cells", True)])
def test_run_options_are_checked_by_type_and_range(case, tmp_path, option, value):
    with pytest.raises(dprelease.SpecError, match=option):
        dprelease.Release.from_yaml(case()).run(ledger=None, key_file=tmp_path / "k.key", **{option: value})
    assert not (tmp_path / "k.key").exists()


def test_open_takes_a_path_or_a_uri_only():
    with pytest.raises(dprelease.SpecError, match="directory = 12"):
        dprelease.ReleaseResult.open(12)


# ---- 18. one-line errors, escaped names, URIs as given ----------------------------------------------------------------

def test_a_ledger_url_whose_driver_is_not_installed_is_one_line(case, tmp_path):
    for command in (["ledger", "list"], ["run", case(), "--key-file", tmp_path / "k.key"]):
        ran = cli(*command, "--ledger", "mysql+nosuchdriver://agency@db/ledger")
        assert ran.returncode == 2 and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
        assert "Traceback" not in ran.stderr and "may quote confidential" not in ran.stderr


def test_submit_leaves_no_temporary_directory(case, tmp_path):
    """Main's submit.sh set its cleanup trap and then `exec`-ed spark-submit: every call left a directory."""
    from .conftest import REPO

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "PYTHON": sys.executable}
    subprocess.run(["bash", str(REPO / "deploy/spark/submit.sh"), "local[1]", "no-such-spec.yaml", "--no-ledger"],
                   capture_output=True, text=True, env=env, timeout=300)
    assert [p for p in temporary.iterdir() if p.name.startswith("tmp")] == []


# ---- review: a release whose tables read no column counts every record, on every engine ----------------------------

@pytest.mark.parametrize("unit", ["pid", None])
def test_a_total_that_reads_no_column_counts_every_record_on_every_engine(case, tmp_path, unit):
    """Found by review: with no encoded column the embedded and Spark engines derived each batch's row count
    from the codes and counted 0, Beam counted right; a free re-run on the other engine would then have
    published the same noise over another count (the exact total). The row count is passed, never derived."""
    import pyarrow as pa

    from dprelease.pipelines.engines.spark import _bound_count_function, _encode_shard_function, _range_steps
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.spec import load_spec

    rows = {"pid": [1, 2, 3, 3, 4], "geo": ["01001000100"] * 5, "age": [1, 2, 3, 4, 5], "sex": ["F"] * 5}
    spec = case(rows=rows, privacy_unit=unit, queries=[{"name": "total", "kind": "histogram", "by": []}],
                budget={"definition": "pure", "epsilon": 1_000_000})
    expected = 4 if unit else 5  # k = 1: unit 3's second record is not counted
    for engine in ("embedded", "beam"):
        released = run_release(spec, key_file=tmp_path / "k.key", out_dir=tmp_path / engine, engine=engine,
                               ledger=None).release_dir
        assert pq.read_table(released / "measurements" / "total.parquet").column("noisy_count").to_pylist() \
            == [expected], engine
    plan = build_plan(*load_spec(spec))  # the Spark executors' read-task and partition kernels, on the same records

    class Reader:
        def batches(self, task):
            return pa.table(rows).to_batches()

    blobs = list(_encode_shard_function(Reader(), ["task"], plan, unit, 7, 2)(iter([pa.record_batch({"task": [0]})])))
    count = _bound_count_function(plan, unit, b"k" * 32, _range_steps(plan))
    emitted = list(count(iter(blobs)))
    assert sum(int(np.frombuffer(blob, np.int64).sum()) for batch in emitted
               for blob in batch.column("counts").to_pylist()) == expected


def test_a_free_rerun_must_reproduce_the_published_measurements(case, tmp_path, monkeypatch):
    """Defence in depth behind the last test: the ledger records a digest of the noisy measurements at the first
    commit, and a free re-run (same key, spec and input) whose measurements differ (another engine or version
    counting otherwise: forced here) is refused before anything is published (exit 3)."""
    from dprelease.pipelines.engines import embedded

    spec = case()
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(1))
    first = run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "a")
    before = (first.release_dir / "manifest.json").read_bytes()
    assert run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "b").key_reused
    counted = embedded.EmbeddedEngine.true_counts

    def one_more(self, plan, source, key, progress, sink=None):
        counts = counted(self, plan, source, key, progress, sink)
        counts["by_sex"][0] += 1
        return counts

    monkeypatch.setattr(embedded.EmbeddedEngine, "true_counts", one_more)
    with pytest.raises(dprelease.BudgetError, match="noisy measurements are not the published release's"):
        run_release(spec, ledger=book, key_file=tmp_path / "k.key", out_dir=tmp_path / "a", overwrite=True)
    assert (first.release_dir / "manifest.json").read_bytes() == before and statuses(book) == [COMMITTED]


def test_read_tasks_are_planned_from_the_bound_bytes_not_the_live_file(case, tmp_path):
    """Found by review: Spark and Beam split a Parquet file into row-group ranges read from the live file's
    footer; a file swapped while the tasks were planned (and put back) made the workers count part of the bound
    bytes only. Tasks now come from the footer of the bytes fingerprinted."""
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.source import open_input
    from dprelease.pipelines.spec import load_spec
    from dprelease.transforms.csprng import ReleaseKey

    rows = {"pid": list(range(800)), "geo": ["01001000100"] * 800, "age": [30] * 800,
            "sex": ["F"] * 100 + ["M"] * 700}
    spec = case(rows=rows)
    data = spec.parent / "input.parquet"
    pq.write_table(pa.table(rows), data, row_group_size=100)  # 8 row groups
    plan = build_plan(*load_spec(spec))
    source = open_input(plan, spec.parent)
    source.fingerprint(ReleaseKey.generate())
    original = data.read_bytes()
    pq.write_table(pa.table(rows), data)  # the live file now has one row group
    tasks = source.read_tasks(4)
    assert sorted(t.row_groups for t in tasks) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    data.write_bytes(original)  # put back: the tasks cover every row group of the bound bytes
    assert sum(b.num_rows for t in tasks for b in source.reader().batches(t)) == 800


def test_a_column_whose_invalid_values_drop_records_carries_every_tables_loss(case, tmp_path):
    """Found by review: with `on_invalid: drop`, one record's invalid value in a column removes it from every
    table, so every table depends on the column; the manifest now charges the column the whole release."""
    spec = small_spec()
    spec["columns"]["sex"]["on_invalid"] = "drop"
    path = write_case(tmp_path / "c", spec)
    root = run_release(path, key_file=tmp_path / "k.key", ledger=None).release_dir
    implied = json.loads((root / "manifest.json").read_text())["implied_loss"]["by_attribute"]
    assert Fraction(implied["sex"]["epsilon"]["fraction"]) == 1  # the release's total: every table
    assert Fraction(implied["age"]["epsilon"]["fraction"]) < 1
    assert verify(root).ok


def test_values_never_decide_whether_an_in_memory_input_fails(case, tmp_path):
    """Found by review: one text value holding a lone surrogate failed a pandas run (and the Beam composite,
    quoting it), and a CSV Dataset with inferred types failed iff one value did not parse. Such values are
    invalid (the column's policy), never an error: both frames of each pair run."""
    import pyarrow.dataset as ds

    frame = _frame()
    bad = frame.copy()
    bad.loc[0, "sex"] = "F\udcff"
    bad["pid"] = bad["pid"].astype(str)
    bad.loc[1, "pid"] = "p\udcff"
    release = dprelease.Release.from_yaml(case())
    for name, data in (("clean", frame), ("bad", bad)):
        result = release.run(data, ledger=None, key_file=tmp_path / f"{name}.key", out_dir=tmp_path / name)
        assert result.table("by_sex") is not None
    clean, dirty = tmp_path / "clean.csv", tmp_path / "dirty.csv"
    frame.to_csv(clean, index=False)
    lines = clean.read_text().splitlines()
    lines[1] = lines[1].split(",", 2)[0] + "," + lines[1].split(",", 2)[1] + ",thirty," + lines[1].rsplit(",", 1)[1]
    dirty.write_text("\n".join(lines) + "\n")
    for path in (clean, dirty):
        result = release.run(ds.dataset(path, format="csv"), ledger=None, key_file=tmp_path / f"{path.stem}.key",
                             out_dir=tmp_path / f"{path.stem}-out")
        assert result.table("by_sex") is not None


def test_the_beam_composite_takes_any_value_as_data(case, tmp_path):
    """A unit id beyond int64 or of another type than the rest: other units, never a failed pipeline (the unit
    is text in every batch). (A lone surrogate cannot travel in a PCollection at all: Beam's own coders refuse it
    before any transform sees it.)"""
    beam = pytest.importorskip("apache_beam")
    from apache_beam.testing.util import assert_that

    from dprelease.pipelines.engines.beam import pipeline_options
    from dprelease.transforms.beam_release import PublishedTables

    release = dprelease.Release.from_yaml(case())

    def record(i: int) -> dict:
        odd = {1: {"pid": 2 ** 70}, 3: {"pid": "seven"}, 4: {"pid": None}, 5: {"sex": 7}}
        return {"pid": i, "geo": "01001000100", "age": 30, "sex": "F", **odd.get(i, {})}

    def published(results):
        assert len(results) == len(release.build_plan().tables)

    with beam.Pipeline(options=pipeline_options(None, ["--direct_running_mode=in_memory"])) as pipeline:
        tables = pipeline | beam.Create(range(50)) | beam.Map(record) | PublishedTables.from_spec(release)
        assert_that(tables, published)


def _keys_in(obj, seen: set, depth: int = 0) -> int:
    """How many ReleaseKey objects an unpickled DoFn holds (its attributes, closures, defaults, arguments)."""
    from dprelease.transforms.csprng import ReleaseKey

    if id(obj) in seen or depth > 8:
        return 0
    seen.add(id(obj))
    if isinstance(obj, ReleaseKey):
        return 1
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_keys_in(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(_keys_in(x, seen, depth + 1) for x in obj.values())
    found = _keys_in(getattr(obj, "__dict__", None) or {}, seen, depth + 1)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            found += _keys_in(cell.cell_contents, seen, depth + 1)
        except ValueError:
            pass
    found += _keys_in(getattr(obj, "__defaults__", None) or (), seen, depth + 1)
    for name in ("args", "kwargs", "_args", "_kwargs", "fn", "_fn"):
        if hasattr(obj, name):
            found += _keys_in(getattr(obj, name), seen, depth + 1)
    return found


def test_the_launchers_beam_graph_holds_no_key(case, tmp_path, monkeypatch):
    """Found by review: `dprelease run --engine beam` pickled the bound key into three steps of its graph (the
    job server, a staging bucket and a job description would hold all the noise). The workers now read it, when
    the pipeline runs, from a private file of the run (removed after it); templates are refused."""
    beam = pytest.importorskip("apache_beam")
    from apache_beam.internal import pickler
    from apache_beam.portability.api import beam_runner_api_pb2

    graphs = []
    run = beam.Pipeline.run

    def inspected(self, *args, **kwargs):
        found = 0
        for transform in self.to_runner_api().components.transforms.values():
            if transform.spec.urn == "beam:transform:pardo:v1":
                payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
                found += _keys_in(pickler.loads(payload.do_fn.payload), set())
        graphs.append(found)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(beam.Pipeline, "run", inspected)
    run_release(case(), key_file=tmp_path / "k.key", ledger=None, engine="beam", workers=1)
    assert graphs and graphs == [0] * len(graphs)
    refused = cli("run", case(), "--no-ledger", "--engine", "beam", "--", "--template_location=/tmp/t")
    assert refused.returncode == 2 and "template" in refused.stderr


def test_a_table_file_that_would_decompress_to_gigabytes_is_refused_from_its_footer(case, tmp_path):
    """Found by review: `ReleaseResult.table()` read an untrusted table with no row bound (a 3.5 MB file asked for
    4 GiB, and a raw ArrowMemoryError left the API). Files are now bounded by their table's cells."""
    import hashlib

    root = run_release(case(), key_file=tmp_path / "k.key", ledger=None).release_dir
    bomb = root / "tables" / "by_sex.parquet"
    pq.write_table(pa.table({"sex": pa.array(["F"] * 5_000_000), "count": pa.array(np.zeros(5_000_000, np.int64))}),
                   bomb, compression="zstd")
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "tables/by_sex.parquet":
            entry.update(sha256=hashlib.sha256(bomb.read_bytes()).hexdigest(), bytes=bomb.stat().st_size)
    (root / "manifest.json").write_text(json.dumps(manifest))
    opened = dprelease.ReleaseResult.open(root)
    with pytest.raises(dprelease.DPReleaseError, match="more rows or bytes than its table can hold"):
        opened.table("by_sex")
    with pytest.raises(dprelease.DPReleaseError, match="more rows or bytes"):
        opened.coding_warnings

"""The release path on the embedded engine: cells, policies, bounding, determinism, atomic publish."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dprelease.accounting.errors import InputSchemaError, SpecError
from dprelease.pipelines import release as release_module
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release

from .conftest import GEO_LEAVES

EXACT = {"definition": "pure", "epsilon": 1000000}  # noise scale 1e-6: the noise is 0 with overwhelming probability


def run(spec_path, tmp_path, name="k.key", **kwargs):
    return run_release(spec_path, key_file=tmp_path / name, **kwargs)


def read(release_dir, folder, table):
    return pq.read_table(release_dir / folder / f"{table}.parquet")


def test_empty_input_has_every_public_cell(case, tmp_path):
    empty = {"pid": pa.array([], pa.int64()), "geo": pa.array([], pa.string()),
             "age": pa.array([], pa.int64()), "sex": pa.array([], pa.string())}
    result = run(case(rows=empty), tmp_path)
    for table in result.plan.tables:
        for folder in ("tables", "measurements"):
            assert read(result.release_dir, folder, table.name).num_rows == table.n_cells
    assert result.plan.table("pop.tract").n_cells == len(GEO_LEAVES) + 1  # + (other)
    assert result.plan.table("agesex.age-sex").n_cells == 3 * 4 * 3  # states+other x bins+other x sex+other


def test_exact_counts_with_other_and_drop_policies(case, tmp_path):
    rows = {"pid": [1, 2, 3, 4, 5, 6],
            "geo": [GEO_LEAVES[0], GEO_LEAVES[0], "99999999999", None, GEO_LEAVES[4], GEO_LEAVES[5]],
            "age": [5, 30, 70, None, 150, 40],
            "sex": ["F", "M", "F", "M", "X", "F"]}
    spec = case(rows=rows, budget=EXACT)
    result = run(spec, tmp_path)
    tract = read(result.release_dir, "tables", "pop.tract").to_pydict()
    counts = dict(zip(tract["tract"], tract["count"]))
    assert counts[GEO_LEAVES[0]] == 2 and counts["(other)"] == 2 and counts[GEO_LEAVES[4]] == 1
    by_sex = read(result.release_dir, "tables", "by_sex").to_pydict()
    sex = dict(zip(by_sex["sex"], by_sex["count"]))
    assert sex == {"F": 3, "M": 2, "(other)": 1}
    # drop policy on age: rows with null or out-of-range age disappear from every table
    document = json.loads(json.dumps(result.plan.spec.model_dump(mode="json")))
    document["columns"]["age"]["on_invalid"] = "drop"
    dropped = case(rows=rows, **{k: v for k, v in document.items() if k not in ("release_id",)})
    result = run(dropped, tmp_path, name="k2.key")
    nation = read(result.release_dir, "tables", "pop.nation").to_pydict()
    assert nation["count"] == [4]


def test_bounding_applies_in_the_pipeline(case, tmp_path):
    rows = {"pid": [7] * 5 + [8], "geo": [GEO_LEAVES[1]] * 6, "age": [20] * 6, "sex": ["M"] * 6}
    result = run(case(rows=rows, budget=EXACT, contribution={"max_records_per_unit": 2}), tmp_path)
    assert read(result.release_dir, "tables", "pop.nation").to_pydict()["count"] == [3]


def test_null_units_are_dropped(case, tmp_path):
    rows = {"pid": [1, None, None], "geo": [GEO_LEAVES[1]] * 3, "age": [20] * 3, "sex": ["M"] * 3}
    result = run(case(rows=rows, budget=EXACT), tmp_path)
    assert read(result.release_dir, "tables", "pop.nation").to_pydict()["count"] == [1]


def test_csv_with_junk_values_and_malformed_rows(tmp_path, case):
    spec_path = case(budget=EXACT, input={"path": "input.csv"})
    (spec_path.parent / "input.csv").write_text(
        "pid,geo,age,sex\n"
        f"1,{GEO_LEAVES[0]},12,F\n"
        f"2,{GEO_LEAVES[0]},twelve,M\n"
        f"3,{GEO_LEAVES[2]},1e400,F\n"
        "4,this row,has,too,many,fields\n"
        f"5,{GEO_LEAVES[2]},33.5,\n"
    )
    result = run(spec_path, tmp_path)
    age = read(result.release_dir, "tables", "agesex.age-sex").to_pydict()
    total_other_age = sum(c for a, c in zip(age["age"], age["count"]) if a == "(other)")
    assert total_other_age == 3
    assert read(result.release_dir, "tables", "pop.nation").to_pydict()["count"] == [4]


def test_same_key_same_input_is_byte_identical(case, tmp_path):
    spec_path = case()
    a = run_release(spec_path, key_file=tmp_path / "same.key", out_dir=tmp_path / "a")
    b = run_release(spec_path, key_file=tmp_path / "same.key", out_dir=tmp_path / "b")
    files_a = sorted(p.relative_to(a.release_dir) for p in a.release_dir.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b.release_dir) for p in b.release_dir.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        if rel.name != "manifest.json":
            assert (a.release_dir / rel).read_bytes() == (b.release_dir / rel).read_bytes(), rel
    ma, mb = (json.loads((r.release_dir / "manifest.json").read_text()) for r in (a, b))
    ma.pop("provenance"), mb.pop("provenance")
    assert ma == mb
    c = run_release(spec_path, key_file=tmp_path / "other.key", out_dir=tmp_path / "c")
    differs = [(a.release_dir / "measurements" / f"{t.name}.parquet").read_bytes()
               != (c.release_dir / "measurements" / f"{t.name}.parquet").read_bytes() for t in a.plan.tables]
    assert any(differs)


def test_published_hierarchy_adds_up(case, tmp_path):
    rng = np.random.default_rng(3)
    n = 400
    rows = {"pid": np.arange(n), "geo": rng.choice(GEO_LEAVES, n), "age": rng.integers(0, 100, n),
            "sex": rng.choice(["F", "M"], n)}
    result = run(case(rows=rows, budget={"definition": "pure", "epsilon": "1/4"}), tmp_path)
    plan = result.plan
    geo = plan.domains["geo"]
    levels = ["nation", "state", "county", "tract"]
    values = {lvl: read(result.release_dir, "tables", f"pop.{lvl}").column("count").to_numpy() for lvl in levels}
    for parent, child in zip(levels, levels[1:]):
        mapping = geo.parent_of(child, parent)
        assert np.array_equal(np.bincount(mapping, values[child], minlength=values[parent].size), values[parent])
        assert (values[child] >= 0).all()
    for table in plan.tables:
        assert (read(result.release_dir, "tables", table.name).column("count").to_numpy() >= 0).all()


def test_existing_release_is_refused_then_overwritten(case, tmp_path):
    spec_path = case()
    run(spec_path, tmp_path)
    with pytest.raises(SpecError, match="already exists"):
        run(spec_path, tmp_path)
    result = run(spec_path, tmp_path, overwrite=True)
    assert verify_release(result.release_dir).ok


def test_crash_while_writing_leaves_no_release(case, tmp_path, monkeypatch):
    spec_path = case()

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(release_module, "dump_manifest", explode)
    with pytest.raises(RuntimeError):
        run(spec_path, tmp_path)
    out = spec_path.parent / "out"
    assert not (out / "test-release").exists()
    assert list(out.iterdir()) == []


def test_missing_column_aborts_before_a_key_is_drawn(case, tmp_path):
    rows = {"pid": [1], "geo": [GEO_LEAVES[0]], "age": [3]}
    with pytest.raises(InputSchemaError, match=r"missing column\(s\) \['sex'\]"):
        run(case(rows=rows), tmp_path)
    assert not (tmp_path / "k.key").exists()


def test_numeric_geography_column_is_a_schema_error(case, tmp_path):
    rows = {"pid": [1], "geo": [1001000100], "age": [3], "sex": ["F"]}
    with pytest.raises(InputSchemaError, match="columns.geo: input column type is int64; allowed: string"):
        run(case(rows=rows), tmp_path)


def test_directory_of_parquet_files(case, tmp_path):
    spec_path = case(budget=EXACT, input={"path": "parts"})
    parts = spec_path.parent / "parts"
    parts.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"pid": [i], "geo": [GEO_LEAVES[i]], "age": [i], "sex": ["F"]}),
                       parts / f"part-{i}.parquet")
    result = run(spec_path, tmp_path)
    assert read(result.release_dir, "tables", "pop.nation").to_pydict()["count"] == [3]


def test_text_stored_dictionary_encoded_is_read_as_dictionaries_and_releases_the_same(case, tmp_path):
    """A Parquet file of plain strings (no Arrow schema saying dictionary, as Spark or DuckDB write them) whose
    text columns are stored dictionary-encoded is read as dictionary arrays (`source.dictionary_columns`: no string
    materialised per value); a column stored plain is read as it is. The same rows as Arrow dictionaries, as
    dictionary-encoded strings and as plain-encoded strings encode to the same codes (invalid UTF-8 and values
    outside the domain included), and each publishes."""
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.source import read_batches
    from dprelease.pipelines.spec import load_spec
    from dprelease.transforms.encode import ColumnEncoder, encoded_table

    rng = np.random.default_rng(5)
    n = 2000
    geo = np.array(GEO_LEAVES + ["bogus"], dtype=object)[rng.integers(0, len(GEO_LEAVES) + 1, n)]
    sex = pa.array(np.array([b"F", b"M", b"\xff\xfe"], dtype=object)[rng.integers(0, 3, n)], pa.binary())
    rows = {"pid": np.arange(n), "geo": pa.array(geo, pa.string()), "age": rng.integers(0, 100, n),
            "sex": sex.cast(pa.string(), safe=False)}
    spec = case(rows=rows)
    table = pq.read_table(spec.parent / "input.parquet")
    forms = {"dictionary": table.set_column(1, "geo", table.column("geo").dictionary_encode()),
             "encoded": table, "plain": table}
    plan = build_plan(*load_spec(spec))
    encoders = {c: ColumnEncoder(plan.domains[c]) for c in plan.encoded_columns()}
    codes = {}
    for form, data in forms.items():
        path = spec.parent / f"{form}.parquet"
        pq.write_table(data, path, use_dictionary=form != "plain", store_schema=form == "dictionary")
        batches = list(read_batches(str(path), "parquet", ["pid", "geo", "sex", "age"]))
        assert pa.types.is_dictionary(batches[0].schema.field("sex").type) == (form != "plain")
        assert pa.types.is_integer(batches[0].schema.field("age").type)
        encoded = pa.concat_tables(encoded_table(b, encoders, "pid") for b in batches)
        codes[form] = {c: encoded.column(c).to_numpy() for c in encoded.column_names if c in encoders}
        result = run_release(spec, input_path=str(path), out_dir=tmp_path / form, key_file=tmp_path / f"{form}.key",
                             ledger=None)
        assert verify_release(result.release_dir).ok
    for form in ("encoded", "plain"):
        assert codes[form].keys() == codes["dictionary"].keys()
        for column, values in codes["dictionary"].items():
            np.testing.assert_array_equal(codes[form][column], values)


@pytest.mark.parametrize("engine", ["embedded", "embedded-workers", "spark"])
def test_a_unit_stored_as_a_dictionary_in_one_file_and_as_text_in_another_is_one_unit(case, tmp_path, monkeypatch,
                                                                                        engine):
    """Found by review: the encoded records of a unit column stored as dictionary<string> in one file and as string
    in another could not be spilled (embedded) or shuffled (Spark) together. Units are made one type per kind of
    value as they are encoded: the unit's 2 records, one in each file, are bounded to k = 1 together."""
    import shutil

    from dprelease.pipelines.engines import embedded

    workers = None
    if engine == "spark":
        pytest.importorskip("pyspark")
    if engine == "embedded-workers":
        monkeypatch.setattr(embedded, "PARTITION_BYTES", 16)
        engine, workers = "embedded", 2
    spec = case(rows={"pid": ["a"], "geo": [GEO_LEAVES[0]], "age": [1], "sex": ["F"]},
                queries=[{"name": "total", "kind": "histogram", "by": []}],
                budget={"definition": "pure", "epsilon": 1_000_000})
    data = spec.parent / "input.parquet"
    data.unlink()
    data.mkdir()
    plain = pa.table({"pid": ["a", "b"], "geo": [GEO_LEAVES[0]] * 2, "age": [1, 2], "sex": ["F", "M"]})
    coded = plain.set_column(0, "pid", pa.array(["a", "c"]).dictionary_encode())
    pq.write_table(plain, data / "part-0.parquet")
    pq.write_table(coded, data / "part-1.parquet")
    assert pq.read_schema(data / "part-1.parquet").field("pid").type != pq.read_schema(data / "part-0.parquet").field(
        "pid").type
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    result = run_release(spec, key_file=tmp_path / "k.key", out_dir=out, ledger=None, engine=engine, workers=workers,
                         **({"master": "local[2]"} if engine == "spark" else {}))
    assert read(result.release_dir, "measurements", "total").column("noisy_count").to_pylist() == [3]  # a once, b, c


def test_spill_partitions_give_the_same_release(case, tmp_path, monkeypatch):
    """Forcing several spill partitions (the large-input path) changes nothing in the output."""
    from dprelease.pipelines.engines import embedded

    rng = np.random.default_rng(5)
    n = 3000
    rows = {"pid": rng.integers(0, 800, n), "geo": rng.choice(GEO_LEAVES, n), "age": rng.integers(0, 100, n),
            "sex": rng.choice(["F", "M"], n)}
    spec_path = case(rows=rows, contribution={"max_records_per_unit": 2})
    a = run_release(spec_path, key_file=tmp_path / "s.key", out_dir=tmp_path / "a")
    monkeypatch.setattr(embedded, "PARTITION_BYTES", 500 * 20)
    b = run_release(spec_path, key_file=tmp_path / "s.key", out_dir=tmp_path / "b", workers=1)
    counted = []
    in_workers = embedded.EmbeddedEngine._counts_in_workers
    monkeypatch.setattr(embedded.EmbeddedEngine, "_counts_in_workers",
                        lambda *args, **kwargs: counted.append(1) or in_workers(*args, **kwargs))
    c = run_release(spec_path, key_file=tmp_path / "s.key", out_dir=tmp_path / "c", workers=2)
    assert counted, "two workers read and counted the spilled input"
    for t in a.plan.tables:
        assert read(a.release_dir, "measurements", t.name) == read(b.release_dir, "measurements", t.name)
        assert read(a.release_dir, "measurements", t.name) == read(c.release_dir, "measurements", t.name)


def _staged_pair(tmp_path):
    """An old published release and a new staged one (private, as finish_release leaves it)."""
    from dprelease.pipelines.release import StagedRelease, new_staging

    final = tmp_path / "out" / "r"
    final.mkdir(parents=True)
    (final / "manifest.json").write_text("old")
    staging, _ = new_staging(final)
    (staging / "manifest.json").write_text("new")
    return StagedRelease(staging, "", ""), final


def _interrupted(function):
    """`function`, then a SIGTERM's exception, as if the signal arrived right after it returned."""
    from dprelease.pipelines.housekeeping import Terminated

    def call(*args, **kwargs):
        function(*args, **kwargs)
        raise Terminated(143)
    return call


def test_overwrite_exchanges_the_releases_in_one_rename_and_a_signal_never_leaves_neither(tmp_path, monkeypatch):
    """Found by review: `--overwrite` moved the old release aside, then renamed the new one in; a SIGTERM between the
    two left neither in place (the next run's sweep then removed the old one), and one just after the second made
    the put-back fail (exit 1, "not published", though it was). Now one rename exchanges them; wherever the signal
    arrives, the release directory holds one complete release, and it is readable by others only once published."""
    import os
    import stat

    from dprelease.pipelines.housekeeping import Terminated

    staged, final = _staged_pair(tmp_path)
    assert stat.S_IMODE(staged.staging.stat().st_mode) == 0o700
    release_module.publish(staged, final, overwrite=True)
    assert (final / "manifest.json").read_text() == "new" and not staged.staging.exists()
    assert stat.S_IMODE(final.stat().st_mode) == 0o755 and os.listdir(final.parent) == ["r"]
    # a signal right after the exchange: the new release is in place, the old one under the staging name
    staged, final = _staged_pair(tmp_path / "a")
    monkeypatch.setattr(release_module, "rename_exchange", _interrupted(release_module.rename_exchange))
    with pytest.raises(Terminated):
        release_module.publish(staged, final, overwrite=True)
    assert (final / "manifest.json").read_text() == "new" and (staged.staging / "manifest.json").read_text() == "old"
    # without renameat2: two renames; a signal after the first puts the old release back
    monkeypatch.setattr(release_module, "rename_exchange", lambda source, target: False)
    staged, final = _staged_pair(tmp_path / "b")
    with monkeypatch.context() as patched:
        patched.setattr(release_module.os, "rename", _interrupted(os.rename))
        with pytest.raises(Terminated):
            release_module.publish(staged, final, overwrite=True)
    assert (final / "manifest.json").read_text() == "old" and (staged.staging / "manifest.json").read_text() == "new"
    # ... and one after the second leaves the new release in place
    monkeypatch.setattr(release_module, "rename_no_replace", _interrupted(release_module.rename_no_replace))
    with pytest.raises(Terminated):
        release_module.publish(staged, final, overwrite=True)
    assert (final / "manifest.json").read_text() == "new"

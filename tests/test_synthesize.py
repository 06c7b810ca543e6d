"""`dprelease synthesize`: microdata whose tabulation reproduces the published hierarchy and marginals."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines.run import run_release

from .conftest import small_spec, write_case


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *args], capture_output=True, text=True)


def release(tmp_path, **overrides):
    rng = np.random.default_rng(0)
    from .conftest import GEO_LEAVES
    n = 400
    rows = {"pid": list(range(n)), "geo": [GEO_LEAVES[i] for i in rng.integers(0, 6, n)],
            "age": rng.integers(0, 100, n).tolist(), "sex": rng.choice(["F", "M"], n).tolist()}
    spec = write_case(tmp_path / "case", small_spec(**overrides), rows)
    return run_release(spec, key_file=tmp_path / "k.key", ledger=None)


def counts(table, by: list[str]) -> dict:
    grouped = table.group_by(by).aggregate([([], "count_all")]).to_pydict()
    return {tuple(grouped[c][i] for c in by): grouped["count_all"][i] for i in range(len(grouped["count_all"]))}


def published(root, name: str, by: list[str]) -> dict:
    table = pq.read_table(root / "tables" / f"{name}.parquet").to_pydict()
    return {tuple(table[c][i] for c in by): table["count"][i] for i in range(len(table["count"])) if table["count"][i]}


def test_synthetic_records_reproduce_every_hierarchy_and_marginal_table(tmp_path):
    result = release(tmp_path)
    out = tmp_path / "synthetic.parquet"
    done = cli("synthesize", str(result.release_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "reproduces exactly: pop.nation, pop.state, pop.county, pop.tract, agesex.age-sex" in " ".join(done.stdout.split())
    records = pq.read_table(out)
    assert records.column_names == ["state", "county", "tract", "age", "sex"]
    root = result.release_dir
    assert records.num_rows == pq.read_table(root / "tables" / "pop.nation.parquet").column("count")[0].as_py()
    for level, by in (("state", ["state"]), ("county", ["county"]), ("tract", ["tract"])):
        assert counts(records, by) == published(root, f"pop.{level}", by)
    assert counts(records, ["state", "age", "sex"]) == published(root, "agesex.age-sex", ["state", "age", "sex"])


def test_synthesize_is_reproducible(tmp_path):
    result = release(tmp_path)
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert cli("synthesize", str(result.release_dir), "--out", str(first)).returncode == 0
    assert cli("synthesize", str(result.release_dir), "--out", str(second)).returncode == 0
    assert pq.read_table(first).equals(pq.read_table(second))


def test_synthesize_refuses_a_release_that_does_not_verify(tmp_path):
    result = release(tmp_path)
    path = result.release_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tables"][0]["cells"] = 7
    path.write_text(json.dumps(manifest))
    done = cli("synthesize", str(result.release_dir))
    assert done.returncode == 1 and "does not verify" in done.stderr


def test_a_hierarchy_crossed_with_by_alone_gives_its_finest_cells_as_records(tmp_path):
    queries = [{"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "tract"],
                "by": ["sex"]}]
    result = release(tmp_path, queries=queries)
    out = tmp_path / "s.parquet"
    done = cli("synthesize", str(result.release_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "reproduces exactly: pop.nation, pop.state, pop.tract" in " ".join(done.stdout.split())
    records = pq.read_table(out)
    for level in ("state", "tract"):
        assert counts(records, [level, "sex"]) == published(result.release_dir, f"pop.{level}", [level, "sex"])


def test_records_follow_the_hierarchy_by_cell_and_the_marginals_exactly(tmp_path):
    """Hierarchy by sex to the tract, marginals of age and sex within state: each state's records (from the
    marginals' joint) are dealt to its tracts per sex. The marginals are reproduced exactly; the hierarchy's
    tracts where the two integer tables agree, else by largest remainders (the state totals always agree)."""
    queries = [{"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "tract"],
                "by": ["sex"]},
               {"name": "agesex", "kind": "marginals", "attributes": ["age", "sex"], "way": 2, "within": "geo.state"}]
    result = release(tmp_path, queries=queries)
    out = tmp_path / "s.parquet"
    done = cli("synthesize", str(result.release_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = pq.read_table(out)
    root = result.release_dir
    assert counts(records, ["state", "age", "sex"]) == published(root, "agesex.age-sex", ["state", "age", "sex"])
    marginal = published(root, "agesex.age-sex", ["state", "age", "sex"])
    tracts = published(root, "pop.tract", ["tract", "sex"])
    by_state = {}
    for (state, _, sex), n in marginal.items():
        by_state[(state, sex)] = by_state.get((state, sex), 0) + n
    dealt = counts(records, ["tract", "sex"])
    for (state, sex), n in by_state.items():  # every (state, sex) group dealt whole, to its own tracts
        assert sum(v for (tract, s), v in dealt.items() if tract.startswith(state) and s == sex) == n
    agree = [(state, sex) for (state, sex), n in by_state.items()
             if sum(v for (tract, s), v in tracts.items() if tract.startswith(state) and s == sex) == n]
    for (tract, sex), n in tracts.items():
        if (tract[:2], sex) in agree:
            assert dealt.get((tract, sex), 0) == n


def test_several_marginals_queries_draw_from_one_and_report_the_others(tmp_path):
    queries = [{"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county"]},
               {"name": "small", "kind": "marginals", "attributes": ["sex"], "way": 1, "within": "geo.state"},
               {"name": "agesex", "kind": "marginals", "attributes": ["age", "sex"], "way": 2, "within": "geo.state"}]
    result = release(tmp_path, queries=queries)
    out = tmp_path / "s.parquet"
    done = cli("synthesize", str(result.release_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "agesex.age-sex" in done.stdout.split("Not reproduced")[0]
    report = json.loads((tmp_path / "s.parquet.utility.json").read_text())
    assert {row["table"] for row in report["tables"]} >= {"small.sex", "agesex.age-sex", "pop.county"}


def test_synthesize_names_what_it_cannot_draw(tmp_path):
    queries = [{"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state"], "by": ["sex"]},
               {"name": "ages", "kind": "marginals", "attributes": ["age"], "way": 1, "within": "geo.state"}]
    result = release(tmp_path, queries=queries)
    done = cli("synthesize", str(result.release_dir))
    assert done.returncode == 2 and "crossed with ['sex'], which marginals 'ages' does not all carry" in \
        " ".join(done.stderr.split())


def test_the_utility_report_measures_each_tabulation_against_the_noisy_measurements(tmp_path):
    """Per table the records tabulate to: L1 to the raw noisy measurement (recomputed here from the release's
    files) and to the published table (0 for the reproduced ones)."""
    result = release(tmp_path)
    out = tmp_path / "synthetic.parquet"
    done = cli("synthesize", str(result.release_dir), "--out", str(out))
    assert done.returncode == 0 and "Utility" in done.stdout
    report = json.loads((tmp_path / "synthetic.parquet.utility.json").read_text())
    rows = {row["table"]: row for row in report["tables"]}
    assert set(rows) >= {"pop.nation", "pop.state", "pop.county", "pop.tract", "agesex.age-sex"}
    root = result.release_dir
    for name, row in rows.items():
        measured = pq.read_table(root / "measurements" / f"{name}.parquet").column("noisy_count").to_numpy()
        published_values = pq.read_table(root / "tables" / f"{name}.parquet").column("count").to_numpy()
        if name == "by_sex":  # another query's table: the records tabulate to it, not exactly
            tabulated = counts(pq.read_table(out), ["sex"])
            labels = pq.read_table(root / "tables" / "by_sex.parquet").column("sex").to_pylist()
            records = np.asarray([tabulated.get((label,), 0) for label in labels])
            assert row["l1_to_published"] == int(np.abs(records - published_values).sum())
        else:
            records = published_values
            assert row["l1_to_published"] == 0  # reproduced exactly
        assert row["l1_to_measurements"] == int(np.abs(records - measured).sum())
        assert row["l1_to_measurements_per_record"] == row["l1_to_measurements"] / published_values.sum()
    again = cli("synthesize", str(result.release_dir), "--out", str(out))
    assert again.returncode == 2  # the records and the report are replaced only with --overwrite


def wide_release(tmp_path, way: int):
    """Six attributes whose joint is over 16 times their largest table, so post-processing makes the marginals
    integral table by table (no joint to draw from); income follows education closely."""
    from .test_mst import dependent_people

    rng = np.random.default_rng(4)
    rows, columns = dependent_people(rng, 900)
    rows.update(c1=rng.choice(list("abcde"), 900).tolist(), c2=rng.choice(list("vwxyz"), 900).tolist())
    spec = small_spec(budget={"definition": "zcdp", "rho": 50, "delta": 1e-9})
    spec["columns"].update(columns, c1={"type": "categorical", "values": list("abcde")},
                           c2={"type": "categorical", "values": list("vwxyz")})
    attributes = ["age", "sex", "edu", "inc", "c1", "c2"]
    spec["queries"] = [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county"]},
        {"name": "m", "kind": "marginals", "attributes": attributes, "way": way, "within": "geo.state"}]
    return run_release(write_case(tmp_path / "case", spec, rows), key_file=tmp_path / "k.key", ledger=None), attributes


def test_marginals_without_a_joint_give_records_from_a_model_of_their_published_tables(tmp_path, monkeypatch):
    """A `select: all` query made integral table by table: the records follow a graphical model of its pairs
    (the maximum spanning tree by dependence beyond noise, then the other dependent pairs within the size cap,
    closing cycles; post-processing of the published tables), per state, as many as the hierarchy publishes;
    every pair table is tabulated and reported, the dependent pair (edu, inc) close to its published table, and
    the draw is reproducible."""
    from dprelease.pipelines.postprocessing import marginals_path
    from dprelease.pipelines.synthesize import synthesize
    from dprelease.transforms.units import graphical

    result, attributes = wide_release(tmp_path, 2)
    assert marginals_path(result.plan, result.plan.spec.queries[1]) != "joint"
    fitted, fit = [], graphical.fit
    with monkeypatch.context() as patched:
        patched.setattr(graphical, "fit", lambda *a, **k: fitted.append(a[2]) or fit(*a, **k))
        synthetic = synthesize(result.release_dir)
    assert len(fitted) == 1 and len(fitted[0]) > len(attributes) - 1  # more pairs than a tree: cycles
    records = synthetic.records
    root = result.release_dir
    assert records.column_names == ["state", "county", *attributes]
    assert counts(records, ["state"]) == published(root, "pop.state", ["state"])
    assert counts(records, ["county"]) == published(root, "pop.county", ["county"])
    rows = {row["table"]: row for row in synthetic.utility}
    assert {f"m.{a}-{b}" for i, a in enumerate(attributes) for b in attributes[i + 1:]} <= set(rows)
    assert rows["m.edu-inc"]["l1_to_published_per_record"] < 0.05  # in the tree: its published table, nearly
    independent = published(root, "m.edu-inc", ["state", "edu", "inc"])
    assert counts(records, ["edu", "inc"])[("college", "low")] < 0.2 * sum(
        v for (s, e, i), v in independent.items() if e == "college")  # the dependence is kept
    assert synthesize(result.release_dir).records.equals(records)


def test_marginals_with_a_tree_over_the_model_cap_give_records_from_the_tree(tmp_path, monkeypatch):
    """Where the spanning tree alone is over the synthesis model's cap (many units), the records follow the tree
    with no fit; the tree's pairs still carry the dependence."""
    from dprelease.pipelines import synthesize as synthesis
    from dprelease.transforms.units import graphical

    result, attributes = wide_release(tmp_path, 2)
    with monkeypatch.context() as patched:
        patched.setattr(synthesis, "SYNTHESIS_MODEL_CELLS", 10)
        patched.setattr(graphical, "fit", lambda *a, **k: pytest.fail("no fit past the cap"))
        synthetic = synthesis.synthesize(result.release_dir)
    records = synthetic.records
    assert records.num_rows == sum(published(result.release_dir, "pop.state", ["state"]).values())
    assert {row["table"]: row for row in synthetic.utility}["m.edu-inc"]["l1_to_published_per_record"] < 0.05


def test_three_way_marginals_without_a_joint_give_records_from_their_pairs(tmp_path):
    from dprelease.pipelines.synthesize import synthesize

    result, attributes = wide_release(tmp_path, 3)
    synthetic = synthesize(result.release_dir)
    assert synthetic.records.num_rows == sum(published(result.release_dir, "pop.state", ["state"]).values())
    assert {row["table"] for row in synthetic.utility} >= {"m.edu-inc-c1", "m.age-sex-edu"}


def test_a_sigterm_while_synthesize_writes_leaves_no_partial_file(tmp_path):
    """Found by review: `synthesize` (like `report` and `demo-data`) ran under no `terminate_as_exit`, so a SIGTERM
    killed it outright and its temporary `.partial` file stayed. Now it cleans up and exits 143."""
    root = release(tmp_path).release_dir
    script = ("import os, signal, sys\n"
              "import dprelease.pipelines.synthesize as s\n"
              "real = s.write_synthetic\n"
              "def write_synthetic(synthetic, handle):\n"
              "    handle.write(b'PAR1')\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return real(synthetic, handle)\n"
              "s.write_synthetic = write_synthetic\n"
              "from dprelease.pipelines.cli import entry\n"
              "entry()\n")
    ran = subprocess.run([sys.executable, "-c", script, "synthesize", str(root), "--out", str(tmp_path / "s.parquet")],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 143, ran.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".s.parquet")] == []
    assert not (tmp_path / "s.parquet").exists()

"""`select: mst` marginals: the selection accounted before any data is read, run, recorded in the manifest,
verified, post-processed into tables that add up, and drawn from by `synthesize`."""
from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines.manifest import MANIFEST_VERSION
from dprelease.pipelines.plan import build_plan, candidate_tables, with_selections
from dprelease.pipelines.spec import load_spec

from .conftest import GEO_LEAVES, small_spec, write_case

ATTRIBUTES = ["age", "sex", "edu", "inc"]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *args], capture_output=True, text=True)


def dependent_people(rng, n: int) -> tuple[dict, dict]:
    """(rows, the spec's columns for edu and inc) of n people in which income follows education closely."""
    edu = rng.integers(0, 3, n)
    inc = np.where(rng.random(n) < 0.95, (edu >= 1).astype(int), 1 - (edu >= 1).astype(int))
    rows = {"pid": list(range(n)), "geo": [GEO_LEAVES[i] for i in rng.integers(0, 6, n)],
            "age": rng.integers(0, 100, n).tolist(), "sex": rng.choice(["F", "M"], n).tolist(),
            "edu": [["school", "college", "degree"][e] for e in edu], "inc": [["low", "high"][i] for i in inc]}
    return rows, {"edu": {"type": "categorical", "values": ["school", "college", "degree"]},
                  "inc": {"type": "categorical", "values": ["low", "high"]}}


def mst_case(directory, budget=None, neighbouring="add_remove", **query):
    """600 people; income follows education closely, so (edu, inc) is the pair worth measuring."""
    rows, columns = dependent_people(np.random.default_rng(3), 600)
    spec = small_spec(budget=budget or {"definition": "zcdp", "rho": 50, "delta": 1e-9}, neighbouring=neighbouring)
    spec["columns"].update(columns)
    spec["queries"] = [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county", "tract"]},
        {"name": "m", "kind": "marginals", "attributes": ATTRIBUTES, "way": 2, "within": "geo.state",
         "select": "mst", **query}]
    return write_case(directory, spec, rows)


@pytest.mark.parametrize("definition", ["pure", "zcdp"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace"])
def test_the_plan_accounts_the_selection_before_any_data_is_read(tmp_path, definition, neighbouring):
    budget = {"definition": "pure", "epsilon": 2} if definition == "pure" else \
        {"definition": "zcdp", "rho": "1/2", "delta": 1e-9}
    path = mst_case(tmp_path / "c", budget, neighbouring)
    plan = build_plan(*load_spec(path))
    [selection] = plan.selections
    assert plan.pending and selection.chosen is None and selection.rounds == 3 and len(selection.candidates) == 6
    assert sorted(t.name for t in plan.tables if t.query == "m") == sorted(f"m.{a}" for a in ATTRIBUTES)
    share = Fraction(1, 2) * plan.allocation_budget  # two queries of weight 1
    assert selection.event.allocated == share / 10  # 9/20 1-way tables, 1/10 selection, 9/20 pair tables
    assert selection.pair_event.allocated == share * Fraction(9, 20) / 3 and sum(
        plan.table(f"m.{a}").event.allocated for a in ATTRIBUTES) == share * Fraction(9, 20)
    factor = 2 if neighbouring == "replace" else 1
    assert selection.event.sensitivity.l1 == factor and selection.pair_event.sensitivity.l1 == factor
    per_round = selection.event.mechanism.epsilon if definition == "pure" else selection.event.mechanism.epsilon ** 2 / 8
    assert selection.event.loss == 3 * per_round <= selection.event.allocated
    total = plan.totals.pure_epsilon if definition == "pure" else plan.totals.rho
    assert total <= plan.allocation_budget and plan.totals.allocated_sum == plan.allocation_budget
    chosen = with_selections(plan, {"m": (("age", "sex"), ("sex", "edu"), ("edu", "inc"))})
    assert not chosen.pending and (chosen.totals.pure_epsilon, chosen.totals.rho) == (plan.totals.pure_epsilon,
                                                                                       plan.totals.rho)
    assert chosen.table("m.edu-inc").event.mechanism == selection.pair_event.mechanism


def test_plan_shows_the_selection_and_the_pairs_still_to_choose(tmp_path):
    path = mst_case(tmp_path / "c")
    done = cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    records = {r["table"]: r for r in json.loads(done.stdout)["tables"]}
    assert records["m.selection"]["mechanism"] == "exponential" and records["m.selection"]["cells"] == 6
    assert records["m.<3 pairs chosen>"]["mechanism"] == "discrete_gaussian"


def run_with_ledger(tmp_path, path):
    """Run the spec from the CLI against a fresh ledger (rho 100 for the test dataset): (release directory, its
    manifest, the ledger's path)."""
    ledger = tmp_path / "ledger.sqlite"
    assert cli("ledger", "set-budget", "test-data", "--rho", "100", "--ledger", str(ledger)).returncode == 0
    done = cli("run", str(path), "--key-file", str(tmp_path / "k.key"), "--ledger", str(ledger))
    assert done.returncode == 0, done.stderr
    root = path.parent / "out" / "test-release"
    return root, json.loads((root / "manifest.json").read_text()), ledger


def test_a_selection_release_runs_verifies_adds_up_and_synthesizes(tmp_path):
    root, manifest, ledger = run_with_ledger(tmp_path, mst_case(tmp_path / "c"))
    [record] = manifest["selections"]
    assert record["rounds"] == 3 and len(record["chosen"]) == 3 and ["edu", "inc"] in record["chosen"]
    assert record["mechanism"]["accounted_as"] == "rho" and record["mechanism"]["selections"] == 3
    names = {t["name"] for t in manifest["tables"]}
    assert {f"m.{a}-{b}" for a, b in record["chosen"]} | {f"m.{a}" for a in ATTRIBUTES} <= names
    assert Fraction(manifest["ledger"]["charged_by_this_run"]) == Fraction(manifest["totals"]["rho"]["fraction"])
    for args in ([], ["--recompute"], ["--ledger", str(ledger)]):
        checked = cli("verify", str(root), *args)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    tables = {t: pq.read_table(root / "tables" / f"m.{t}.parquet").to_pandas() for t in
              ATTRIBUTES + [f"{a}-{b}" for a, b in record["chosen"]]}
    state = pq.read_table(root / "tables" / "pop.state.parquet").to_pandas()
    for a, b in record["chosen"]:
        pair = tables[f"{a}-{b}"]
        assert (pair["count"] >= 0).all()
        for attribute in (a, b):  # each pair's margins are the published 1-way tables
            margin = pair.groupby(["state", attribute], sort=False)["count"].sum().reset_index()
            one_way = tables[attribute].merge(margin, on=["state", attribute], suffixes=("", "_pair"))
            assert (one_way["count"] == one_way["count_pair"]).all() and len(one_way) == len(tables[attribute])
    per_state = tables["age"].groupby("state")["count"].sum()
    assert per_state.to_dict() == dict(zip(state["state"], state["count"]))
    out = tmp_path / "synthetic.parquet"
    synthesized = cli("synthesize", str(root), "--out", str(out))
    assert synthesized.returncode == 0, synthesized.stderr
    text = " ".join(synthesized.stdout.split())
    assert "Not reproduced" not in text and "m.edu-inc" in text and "pop.tract" in text
    records = pq.read_table(out)
    assert records.column_names == ["state", "county", "tract", *ATTRIBUTES]
    assert records.num_rows == int(state["count"].sum())


def test_verify_refuses_a_selection_that_is_not_a_spanning_tree(tmp_path):
    path = mst_case(tmp_path / "c")
    assert cli("run", str(path), "--key-file", str(tmp_path / "k.key"), "--no-ledger").returncode == 0
    root = path.parent / "out" / "test-release"
    original = (root / "manifest.json").read_text()
    for chosen, expected in (([["age", "sex"], ["sex", "edu"], ["age", "edu"]], "closes a cycle"),
                             ([["age", "sex"], ["sex", "edu"]], "a spanning tree of 4 attributes has 3"),
                             ([["age", "sex"], ["sex", "edu"], ["inc", "edu"]], "not a pair of its attributes"),
                             ("all", "not a list of attribute pairs")):
        manifest = json.loads(original)
        manifest["selections"][0]["chosen"] = chosen
        (root / "manifest.json").write_text(json.dumps(manifest))
        checked = cli("verify", str(root))
        assert checked.returncode == 1 and expected in " ".join((checked.stdout + checked.stderr).split()), \
            checked.stdout + checked.stderr
    manifest = json.loads(original)
    del manifest["selections"]
    (root / "manifest.json").write_text(json.dumps(manifest))
    checked = cli("verify", str(root))
    assert checked.returncode == 1 and "the tables chosen by ['m'] are missing" in " ".join(checked.stderr.split())


def test_a_pure_epsilon_selection_release_verifies(tmp_path):
    path = mst_case(tmp_path / "c", {"definition": "pure", "epsilon": 4}, "replace")
    assert cli("run", str(path), "--key-file", str(tmp_path / "k.key"), "--no-ledger").returncode == 0
    root = path.parent / "out" / "test-release"
    record = json.loads((root / "manifest.json").read_text())["selections"][0]
    assert record["mechanism"]["accounted_as"] == "epsilon" and record["sensitivity"]["l1"] == 2
    checked = cli("verify", str(root), "--recompute")
    assert checked.returncode == 0, checked.stdout


def test_mst_needs_two_way_tables(tmp_path):
    path = mst_case(tmp_path / "c", way=3)
    done = cli("plan", str(path))
    assert done.returncode == 2
    assert "select = 'mst': needs way = 2" in " ".join(done.stderr.split())


def test_an_engine_that_cannot_score_candidates_is_refused_before_the_ledger(tmp_path):
    """Every engine shipped scores candidates; an engine without `score_candidates` (a user's own subclass) is
    refused by the check `run` makes before it reserves budget."""
    from types import SimpleNamespace

    from dprelease.accounting.errors import SpecError
    from dprelease.pipelines.engines.beam import BeamEngine
    from dprelease.pipelines.engines.embedded import EmbeddedEngine
    from dprelease.pipelines.engines.spark import SparkEngine
    from dprelease.pipelines.selection import check_engine_selects

    plan = build_plan(*load_spec(mst_case(tmp_path / "c")))
    assert all(engine.scores_candidates for engine in (EmbeddedEngine, SparkEngine, BeamEngine))
    with pytest.raises(SpecError, match="the own engine does not") as refused:
        check_engine_selects(plan, SimpleNamespace(name="own", scores_candidates=False))
    assert refused.value.exit_code == 2


def test_names_a_pair_could_share_are_refused_before_any_data_is_read(tmp_path):
    for attributes, clash in ((["x", "y-z", "x-y", "z"], "m.x-y-z"), (["selection", "sex"], "m.selection")):
        spec = small_spec()
        spec["columns"] = {a: {"type": "categorical", "values": ["p", "q"]} for a in attributes}
        spec["queries"] = [{"name": "m", "kind": "marginals", "attributes": attributes, "select": "mst"}]
        path = write_case(tmp_path / attributes[0], spec)
        done = cli("plan", str(path))
        assert done.returncode == 2 and clash in done.stderr, done.stderr


def test_the_cell_limit_counts_every_candidate_pair(tmp_path):
    """The release's own cells fit the cap; its candidate pairs' counts, at their share of memory, do not."""
    path = mst_case(tmp_path / "c")
    plan = build_plan(*load_spec(path))
    done = cli("run", str(path), "--no-ledger", "--max-cells", str(plan.n_cells), "--key-file", str(tmp_path / "k.key"))
    assert done.returncode == 2 and "counts candidate tables" in " ".join(done.stderr.split())
    assert "219 candidate cells at once, as much memory as 18 release cells" in " ".join(done.stderr.split())


def test_a_run_that_fails_after_its_selection_stays_charged_and_republishes_free(tmp_path, monkeypatch):
    """What follows a selection depends on its draws (tables, their sizes, the time they take): a failure
    or a kill there must not refund the budget, or a run could be repeated until a selection pleased."""
    from dprelease.accounting.errors import PublishError
    from dprelease.pipelines import run as run_module

    path = mst_case(tmp_path / "c")
    ledger = tmp_path / "ledger.sqlite"
    assert cli("ledger", "set-budget", "test-data", "--rho", "100", "--ledger", str(ledger)).returncode == 0

    def crash(*args, **kwargs):
        raise RuntimeError("true count 17 in cell (F, degree)")  # a kernel's text can quote data

    with monkeypatch.context() as patch:
        patch.setattr(run_module, "_release_and_stage", crash)
        with pytest.raises(PublishError, match="charged in the ledger when its selection started") as failed:
            run_module.run_release(path, key_file=tmp_path / "k.key", ledger=ledger)
    assert "true count" not in str(failed.value) and "RuntimeError" in str(failed.value)
    shown = cli("ledger", "show", "test-data", "--ledger", str(ledger))
    assert "committed" in shown.stdout and "test-release" in shown.stdout
    spent = " ".join(shown.stdout.split())
    result = run_module.run_release(path, key_file=tmp_path / "k.key", ledger=ledger)
    manifest = json.loads((result.release_dir / "manifest.json").read_text())
    assert manifest["ledger"]["charged_by_this_run"] == "0" and manifest["ledger"]["rerun_of_committed_release"]
    assert " ".join(cli("ledger", "show", "test-data", "--ledger", str(ledger)).stdout.split()) .count("committed") == \
        spent.count("committed")
    assert cli("verify", str(result.release_dir), "--ledger", str(ledger)).returncode == 0


def test_a_selection_query_needs_no_parameters(tmp_path):
    """`{name, kind: marginals, select: mst}`: every non-geography column, way 2, the default split; the
    columns are written into the spec (its hash and manifest say which). A plain marginals query still needs
    its attributes."""
    spec = small_spec()
    spec["queries"] = [{"name": "m", "kind": "marginals", "select": "mst"}]
    path = write_case(tmp_path / "c", spec)
    plan = build_plan(*load_spec(path))
    assert plan.spec.queries[0].attributes == ["age", "sex"] and plan.selections[0].rounds == 1
    assert plan.spec.model_dump(mode="json")["queries"][0]["attributes"] == ["age", "sex"]
    spec["queries"] = [{"name": "m", "kind": "marginals"}]
    done = cli("plan", str(write_case(tmp_path / "d", spec)))
    assert done.returncode == 2 and "queries[0].attributes: required" in done.stderr


def test_tree_tables_add_up_and_a_unit_gets_the_same_tables_alone_or_in_a_batch():
    from dprelease.transforms.units.tree_model import sample_tree, tree_tables

    rng = np.random.default_rng(5)
    attributes, sizes = ["a", "b", "c", "d"], {"a": 3, "b": 7, "c": 2, "d": 40}
    pairs = [("a", "b"), ("c", "b"), ("b", "d")]
    units = 9
    totals = rng.integers(0, 300, units)
    margins = {x: rng.normal(totals[:, None] / sizes[x], 20, (units, sizes[x])) for x in attributes}
    tables = [rng.normal(totals[:, None, None] / (sizes[a] * sizes[b]), 20, (units, sizes[a], sizes[b]))
              for a, b in pairs]
    one_way, out = tree_tables(totals, margins["a"], attributes, pairs, tables, margins, [400.0] * 3)
    for (a, b), table in zip(pairs, out):
        assert table.dtype == np.int64 and (table >= 0).all()
        assert np.array_equal(table.sum(axis=2), one_way[a]) and np.array_equal(table.sum(axis=1), one_way[b])
    assert all(np.array_equal(one_way[x].sum(axis=1), totals) for x in attributes)
    alone = tree_tables(totals[4:5], margins["a"][4:5], attributes, pairs, [t[4:5] for t in tables],
                        {x: m[4:5] for x, m in margins.items()}, [400.0] * 3)
    assert all(np.array_equal(alone[1][i][0], out[i][4]) for i in range(len(pairs)))
    unit, codes = sample_tree(totals, margins["a"], attributes, pairs, tables, 1, margins, [400.0] * 3)
    for (a, b), table in zip(pairs, out):
        tabulated = np.zeros_like(table)
        np.add.at(tabulated, (unit, codes[a], codes[b]), 1)
        assert np.array_equal(tabulated, table)


def test_a_key_that_cannot_be_saved_before_the_selection_releases_the_reservation(tmp_path):
    path = mst_case(tmp_path / "c")
    ledger = tmp_path / "ledger.sqlite"
    assert cli("ledger", "set-budget", "test-data", "--rho", "100", "--ledger", str(ledger)).returncode == 0
    (tmp_path / "afile").write_text("not a directory")
    done = cli("run", str(path), "--key-file", str(tmp_path / "afile" / "k.key"), "--ledger", str(ledger))
    assert done.returncode != 0
    shown = cli("ledger", "show", "test-data", "--ledger", str(ledger)).stdout
    assert "aborted" in shown and "committed" not in shown  # released, never left reserved


@pytest.mark.parametrize("engine", ["spark", "beam"])
def test_spark_and_beam_select_the_same_tables_and_publish_the_same_release(tmp_path, engine):
    """Spark executors and Beam workers score every candidate range by range (only integer scores reach the
    driver) and the driver chooses with the same key: the same pairs and, file for file, the release the
    embedded engine publishes. At a small budget the draws depend on the exact scores, so equal choices are
    evidence of equal scores."""
    path = mst_case(tmp_path / "c", budget={"definition": "zcdp", "rho": "1/2", "delta": 1e-9})
    assert_same_selection_and_release(tmp_path, path, engine)


def assert_same_selection_and_release(tmp_path, path, engine: str) -> None:
    """Run the spec on the embedded engine and on `engine` (Spark local[2], or Beam's DirectRunner with 2 workers)
    with one key: the same tables chosen and, file for file, the same release."""
    pytest.importorskip("pyspark" if engine == "spark" else "apache_beam")
    if engine == "spark" and subprocess.run(["which", "java"], capture_output=True).returncode != 0:
        pytest.skip("no Java runtime")
    from dprelease.pipelines import run as run_module

    from .test_spark import assert_same_release

    key = tmp_path / "k.key"
    embedded = run_module.run_release(path, key_file=key, ledger=None, out_dir=tmp_path / "embedded")
    options = {"master": "local[2]"} if engine == "spark" else \
        {"beam_options": ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]}
    other = run_module.run_release(path, key_file=key, ledger=None, out_dir=tmp_path / engine, engine=engine,
                                   **options)
    chosen = [json.loads((r.release_dir / "manifest.json").read_text())["selections"][0]["chosen"]
              for r in (embedded, other)]
    assert chosen[0] == chosen[1]
    assert_same_release(embedded.release_dir, other.release_dir, engine)


def test_range_scores_add_up_to_the_whole_tables_score():
    """What the engines compute (range by range, any split) equals the score whose sensitivity is proved:
    `pair_score` against `pair_estimate`, over units of which some have noisy 1-way tables clipped to zero."""
    from dprelease.transforms.mst import CliqueEstimate, independent_estimates, pair_estimate, pair_score, range_score

    rng = np.random.default_rng(5)
    for _ in range(200):
        units, a, b = (int(v) for v in rng.integers(1, 6, size=3))
        one_way = [rng.integers(-8, 30, size=(units, size)) for size in (a, b)]
        one_way[0][rng.random(units) < 0.3] = -1  # clipped to all zero: a uniform share
        totals, (share_a, share_b) = independent_estimates(one_way)
        counts = rng.integers(0, 12, size=units * a * b) * (rng.random(units * a * b) < 0.5)
        whole = pair_score(counts.reshape(units, a, b), pair_estimate(totals, share_a, share_b))
        cuts = np.unique(np.concatenate([[0, counts.size], rng.integers(0, counts.size + 1, size=3)]))
        estimate = CliqueEstimate.pair(totals, share_a, share_b)
        parts = [range_score(counts[lo:hi], int(lo), estimate) for lo, hi in zip(cuts, cuts[1:])]
        assert sum(parts) == whole


def test_each_round_scores_a_pair_less_the_expected_error_of_measuring_it(tmp_path, monkeypatch):
    """The exponential mechanism gets every candidate's score less round(sqrt(2/pi) sigma cells), sigma the pair
    tables' noise standard deviation and cells the pair table's (units x a x b): a public constant per pair."""
    import math

    from dprelease.pipelines import selection as selection_module
    from dprelease.pipelines.engines.embedded import EmbeddedEngine
    from dprelease.pipelines.run import run_release

    raw, given = {}, {}
    score = EmbeddedEngine.score_candidates
    monkeypatch.setattr(EmbeddedEngine, "score_candidates", lambda self, *a, **k: raw.update(score(self, *a, **k)) or raw)
    select_tree = selection_module.select_tree
    monkeypatch.setattr(selection_module, "select_tree",
                        lambda key, name, attributes, candidates, scores, *rest:
                        given.update(zip(candidates, scores)) or select_tree(key, name, attributes, candidates, scores, *rest))
    path = mst_case(tmp_path / "c")
    result = run_release(path, key_file=tmp_path / "k.key", ledger=None)
    plan = build_plan(*load_spec(path))
    [selection] = plan.selections
    sigma = math.sqrt(selection.pair_event.mechanism.variance())
    sizes = {d.column: d.size for t in plan.tables if t.query == "m" for d in t.dims[1:]}
    states = plan.tables[[t.query for t in plan.tables].index("m")].dims[0].size
    assert len(given) == 6 and states >= 2  # the within level's units: every state of the domain file
    for (a, b), value in given.items():
        assert value == raw[f"m.{a}-{b}"] - round(math.sqrt(2 / math.pi) * sigma * states * sizes[a] * sizes[b])
    assert result.release_dir.is_dir()


def fields_of_version(root, version: int) -> dict:
    """The implied loss and post-processing steps as a manifest of `version` states them (before 6: without the
    selections, and without the statement of which tables agree)."""
    from dprelease.pipelines.manifest import implied_loss
    from dprelease.pipelines.postprocessing import steps_applied
    from dprelease.pipelines.verify import verify_release

    plan = verify_release(root).plan
    return json.loads(json.dumps({"implied_loss": implied_loss(plan, version),
                                  "post_processing": steps_applied(plan, version)}))


def test_a_version_3_manifest_verifies_with_the_score_of_its_time(tmp_path):
    """Releases published before the noise penalty (manifest version 3) state the plain L1 score and still
    verify; a version-4 manifest stating the old score, or a version-3 one stating the new, does not."""
    from dprelease.pipelines.manifest import NOISE_PENALTY, SELECTION_SCORE
    from dprelease.pipelines.run import run_release
    from dprelease.pipelines.verify import verify_release

    path = mst_case(tmp_path / "c")
    root = run_release(path, key_file=tmp_path / "k.key", ledger=None).release_dir
    manifest_path = root / "manifest.json"
    published = json.loads(manifest_path.read_text())
    assert published["manifest_version"] == MANIFEST_VERSION and published["selections"][0]["score"] == SELECTION_SCORE + NOISE_PENALTY
    assert verify_release(root).ok
    for version, score, ok in ((3, SELECTION_SCORE, True), (4, SELECTION_SCORE + NOISE_PENALTY, True),
                               (4, SELECTION_SCORE, False),
                               (3, SELECTION_SCORE + NOISE_PENALTY, False)):
        edited = json.loads(json.dumps(published))
        edited["manifest_version"] = version
        edited["selections"][0]["score"] = score
        edited.update(fields_of_version(root, version))
        manifest_path.write_text(json.dumps(edited, indent=1))
        report = verify_release(root)
        assert report.ok == ok, report.problems
        if not ok:
            assert any("selections" in problem for problem in report.problems), report.problems


def test_the_score_stated_is_part_of_the_plan_fingerprint(tmp_path, monkeypatch):
    """A dprelease that scores differently chooses differently: its plan fingerprint (bound into the key and
    recorded in the ledger) differs, so a release charged under the other score is never re-run free."""
    from dprelease.pipelines import manifest as manifest_module

    plan = build_plan(*load_spec(mst_case(tmp_path / "c")))
    current = manifest_module.plan_fingerprint(plan)
    monkeypatch.setattr(manifest_module, "NOISE_PENALTY", "")
    assert manifest_module.plan_fingerprint(plan) != current


def test_a_round_is_unchanged_by_scores_far_below_the_best():
    """Penalties can put a candidate's score far below the others (or below -2^63): the distances handed to the
    kernel are capped, never wrapped, and the round still picks among the competitive pairs alone."""
    from dprelease.transforms.csprng import ReleaseKey
    from dprelease.transforms.mst import select_tree

    candidates = [("a", "b"), ("a", "c"), ("b", "c")]
    for low in (-(2 ** 63 - 50), -(2 ** 70)):
        picks = {select_tree(ReleaseKey(bytes([i]) * 32), "s", ["a", "b", "c"], candidates, [50, low, 40], Fraction(1), 1)[0]
                 for i in range(40)}
        assert ("a", "c") not in picks


def test_workload_weights_are_aims_and_every_pair_alike_without_one():
    """AIM's w_r = sum_s weight_s |r & s|, divided by the weights' common divisor: a workload of every pair (or
    none) weighs every pair alike; a workload about one attribute weighs its pairs most."""
    import itertools

    from dprelease.transforms.mst import workload_weights

    attributes = ["a", "b", "c", "d"]
    pairs = list(itertools.combinations(attributes, 2))
    assert workload_weights(pairs, None) == [1] * 6
    assert workload_weights(pairs, [(p, 1) for p in pairs]) == [1] * 6  # 2 + 2 * 2 = 6 each, over their gcd
    about_d = dict(zip(pairs, workload_weights(pairs, [(("a", "d"), 1), (("b", "d"), 1), (("c", "d"), 1)])))
    assert about_d[("a", "d")] == 2 and about_d[("a", "b")] == 1  # 2 + 1 + 1 = 4 against 1 + 1 = 2
    weighted = dict(zip(pairs, workload_weights(pairs, [(("a", "b", "c"), 3), (("d",), 1)])))
    # 3 * 2 = 6 within the triple, 3 * 1 + 1 * 1 = 4 across it; over their common divisor 2
    assert weighted == {("a", "b"): 3, ("a", "c"): 3, ("b", "c"): 3, ("a", "d"): 2, ("b", "d"): 2, ("c", "d"): 2}


def test_a_workload_weights_the_scores_scales_the_sensitivity_and_verifies(tmp_path, monkeypatch):
    """With a workload the exponential mechanism gets each pair's penalised score times its weight, calibrated
    to the unweighted sensitivity times the largest weight; the manifest states the weights, verify recomputes
    them, and a manifest whose weights or sensitivity were edited fails."""
    from dprelease.pipelines import selection as selection_module
    from dprelease.pipelines.engines.embedded import EmbeddedEngine
    from dprelease.pipelines.run import run_release
    from dprelease.pipelines.verify import verify_release

    workload = [{"attributes": ["inc", "age"]}, {"attributes": ["inc", "sex"]}, {"attributes": ["inc", "edu"], "weight": 2}]
    raw, given, calibrated = {}, {}, []
    score = EmbeddedEngine.score_candidates
    monkeypatch.setattr(EmbeddedEngine, "score_candidates", lambda self, *a, **k: raw.update(score(self, *a, **k)) or raw)
    select_tree = selection_module.select_tree
    monkeypatch.setattr(selection_module, "select_tree",
                        lambda key, name, attributes, candidates, scores, epsilon, sensitivity:
                        given.update(zip(candidates, scores)) or calibrated.append(sensitivity)
                        or select_tree(key, name, attributes, candidates, scores, epsilon, sensitivity))
    path = mst_case(tmp_path / "c", neighbouring="replace", workload=workload)
    root = run_release(path, key_file=tmp_path / "k.key", ledger=None).release_dir
    [selection] = build_plan(*load_spec(path)).selections
    # pairs with inc: 2 * own weight + the other marginals' 1s; (edu, inc): 2*2 + 1 + 1 = 6, (age, inc) 2 + 1 + 2 = 5,
    # (age, edu): 1 + 2 = 3, (age, sex): 1 + 1 = 2
    weights = dict(zip(selection.candidates, selection.weights))
    assert weights == {("age", "sex"): 2, ("age", "edu"): 3, ("age", "inc"): 5, ("sex", "edu"): 3,
                       ("sex", "inc"): 5, ("edu", "inc"): 6}
    assert calibrated == [2 * 6] and selection.event.sensitivity.l1 == 12  # replace, k = 1: 2k times 6
    noise = selection_module.noise_penalty
    cells = {t.name: t.n_cells for t in candidate_tables(build_plan(*load_spec(path)), selection)}
    variance = selection.pair_event.mechanism.variance()
    assert len(given) == 6
    for (a, b), value in given.items():
        assert value == weights[(a, b)] * (raw[f"m.{a}-{b}"] - noise(cells[f"m.{a}-{b}"], variance))
    manifest_path = root / "manifest.json"
    published = json.loads(manifest_path.read_text())
    [record] = published["selections"]
    assert record["sensitivity"]["l1"] == 12 and "workload weight" in record["score"]
    assert {tuple(w["pair"]): w["weight"] for w in record["workload_weights"]} == weights
    assert verify_release(root).ok
    for edit in (lambda r: r["workload_weights"][0].update(weight=1), lambda r: r["sensitivity"].update(l1=2),
                 lambda r: r.pop("workload_weights")):
        edited = json.loads(json.dumps(published))
        edit(edited["selections"][0])
        manifest_path.write_text(json.dumps(edited, indent=1))
        report = verify_release(root)
        assert not report.ok and any("selections" in p for p in report.problems), report.problems
    # relabelled as version 3 (no noise penalty): a weighted plain score no dprelease ever computed
    from dprelease.pipelines.manifest import NOISE_PENALTY

    edited = json.loads(json.dumps(published))
    edited["manifest_version"] = 3
    edited["selections"][0]["score"] = edited["selections"][0]["score"].replace(NOISE_PENALTY, "")
    manifest_path.write_text(json.dumps(edited, indent=1))
    report = verify_release(root)
    assert not report.ok and any("has a workload, which manifests state from version 4 on" in p
                                 for p in report.problems), report.problems


@pytest.mark.parametrize("workload, expected", [
    ([{"attributes": ["inc", "zip"]}], "queries[1].workload[0].attributes[1] = 'zip': not one of the query's attributes"),
    ([{"attributes": ["inc", "inc"]}], "queries[1].workload[0].attributes[1] = 'inc': listed twice in one marginal"),
    ([{"attributes": ["inc"], "weight": 0}], "queries[1].workload[0].weight = 0: Input should be greater than or equal to 1"),
    ([{"attributes": ["inc"], "weight": 1001}], "queries[1].workload[0].weight = 1001: Input should be less than or equal to 1000"),
    ([], "queries[1].workload = []"),
    ([{"attributes": ["inc"], "weight": "2"}], "queries[1].workload[0].weight = '2': Input should be a valid integer"),
    ([{"attributes": ["inc"], "weight": 2.0}], "queries[1].workload[0].weight = 2.0: Input should be a valid integer"),
    ([{"attributes": ["inc"], "weight": True}], "queries[1].workload[0].weight = True: Input should be a valid integer"),
])
def test_a_bad_workload_is_refused_naming_the_field(tmp_path, workload, expected):
    done = cli("plan", str(mst_case(tmp_path / "c", workload=workload)))
    assert done.returncode == 2 and expected in " ".join(done.stderr.split()), done.stderr


def test_a_workload_needs_a_selection(tmp_path):
    path = mst_case(tmp_path / "c", select="all", workload=[{"attributes": ["inc", "age"]}])
    done = cli("plan", str(path))
    assert done.returncode == 2 and "queries[1].workload: only a `select: mst` or `select: aim` query takes a workload" in \
        " ".join(done.stderr.split()), done.stderr


def test_the_largest_workload_a_spec_allows_fits_the_selection_kernel():
    """The caps on a workload (10,000 marginals of weight 1000) and on k (10,000 records per unit, replace) keep
    2 * sensitivity * the selection epsilon's denominator within the kernel's 62 bits: no run can fail there
    after its budget is charged."""
    from dprelease.accounting.mechanisms import _MAX_DENOMINATOR
    from dprelease.accounting.sensitivity import ContributionBounds, mst_score_sensitivity
    from dprelease.pipelines.spec import MAX_RECORDS_PER_UNIT, MAX_WORKLOAD_MARGINALS, MAX_WORKLOAD_WEIGHT

    largest_weight = 2 * MAX_WORKLOAD_WEIGHT * MAX_WORKLOAD_MARGINALS
    sensitivity = mst_score_sensitivity(ContributionBounds(MAX_RECORDS_PER_UNIT, "replace"), largest_weight).l1
    assert 2 * sensitivity * _MAX_DENOMINATOR <= 2 ** 62

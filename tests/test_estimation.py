"""The global least-squares estimate and its per-cell variances: exact against closed forms and dense
linear algebra, consistent on every link, published and verified with the release."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines.manifest import MANIFEST_VERSION, sha256_file
from dprelease.pipelines.postprocessing import CONSISTENCY_STATED, LEGACY_STEPS, STEPS, estimate_variances
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release
from dprelease.transforms.domains import Dimension, GeographyDomain
from dprelease.transforms.estimation import (CountTable, common_coarsening, constraint_matrix,
                                             generalised_least_squares, gls_variances, projection)
from dprelease.transforms.postprocess import hierarchical_least_squares, top_down_hierarchy

from .conftest import small_spec, write_case

LEAVES = tuple(sorted({f"{s:02d}{c:03d}{t:02d}" for s, cs in enumerate([3, 1, 4]) for c in range(cs)
                       for t in range(1 + (s + c) % 3)}))
GEO = GeographyDomain("geo", (("state", 2), ("county", 5), ("tract", 7)), LEAVES)
GEOGRAPHIES = {"geo": GEO}
A, B, C = Dimension("a", None, 3), Dimension("b", None, 2), Dimension("c", None, 4)


def level(name: str) -> Dimension:
    return Dimension("geo", name, GEO.level_size(name))


def hierarchy(variances, by=()) -> list[CountTable]:
    names = ["nation", "state", "county", "tract"]
    return [CountTable(n, (level(n),) + tuple(by), v) for n, v in zip(names, variances)]


def dense_gls(tables, noisy):
    """Textbook GLS in measurement space with dense pseudo-inverses: estimate and its covariance diagonal."""
    constraints = constraint_matrix(tables, GEOGRAPHIES).toarray()
    v = np.diag(np.concatenate([np.full(t.n_cells, t.variance) for t in tables]))
    inverse = np.linalg.pinv(constraints @ v @ constraints.T)
    y = np.concatenate(noisy)
    estimate = y - v @ constraints.T @ inverse @ constraints @ y
    covariance = v - v @ constraints.T @ inverse @ constraints @ v
    return estimate, np.diag(covariance)


def mixed() -> list[CountTable]:
    """A hierarchy, 2-way marginals within county, a county histogram and a national total: links
    between levels carry unit totals only (the exact case)."""
    return hierarchy([4.0, 9.0, 2.0, 5.0]) + [
        CountTable("ab", (level("county"), A, B), 3.0), CountTable("ac", (level("county"), A, C), 6.0),
        CountTable("bc", (level("county"), B, C), 2.0), CountTable("total", (), 1.0),
        CountTable("county_b", (level("county"), B), 8.0)]


def noisy_for(tables, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 3, t.n_cells) for t in tables]


def test_gls_on_a_hierarchy_is_the_tree_blue():
    tables = hierarchy([4.0, 9.0, 0.0, 5.0], by=(B,))  # county level an invariant
    noisy = noisy_for(tables)
    maps = [None] + [GEO.parent_of(tables[i].dims[0].level, tables[i - 1].dims[0].level) for i in range(1, 4)]
    expected = hierarchical_least_squares([n.reshape(-1, 2) for n in noisy], [t.variance for t in tables], maps)
    estimates = generalised_least_squares(tables, noisy, GEOGRAPHIES)
    for got, want in zip(estimates, expected):
        np.testing.assert_allclose(got, want.ravel(), atol=1e-8)
    np.testing.assert_array_equal(estimates[2], noisy[2])  # the invariant is held exact


def test_gls_is_consistent_on_every_pair_and_equals_dense_gls():
    tables = mixed() + [CountTable("state_c", (level("state"), C), 7.0), CountTable("a", (A,), 2.5)]
    noisy = noisy_for(tables, 1)
    estimates = generalised_least_squares(tables, noisy, GEOGRAPHIES)
    expected, _ = dense_gls(tables, noisy)
    np.testing.assert_allclose(np.concatenate(estimates), expected, atol=1e-7)
    for i in range(len(tables)):
        for j in range(i + 1, len(tables)):
            common = common_coarsening(tables[i], tables[j], GEOGRAPHIES)
            left = projection(tables[i], common, GEOGRAPHIES) @ estimates[i]
            right = projection(tables[j], common, GEOGRAPHIES) @ estimates[j]
            np.testing.assert_allclose(left, right, atol=1e-7, err_msg=f"{tables[i].name} vs {tables[j].name}")


@pytest.mark.parametrize("tables", [mixed(), hierarchy([4.0, 9.0, 2.0, 5.0], by=(B, C)),
                                    hierarchy([4.0, 0.0, 2.0, 5.0], by=(B,)) + [CountTable("bc", (level("county"), B, C), 3.0)],
                                    [CountTable("abc", (A, B, C), 3.0), CountTable("ab", (A, B), 1.5),
                                     CountTable("bc", (B, C), 4.0), CountTable("a", (A,), 7.0),
                                     CountTable("c", (C,), 0.0), CountTable("total", (), 2.0)]],
                         ids=["mixed", "hierarchy-by", "hierarchy-by-and-marginals", "marginals-unequal-and-invariant"])
def test_variances_are_exact_where_links_across_levels_are_totals(tables):
    """Against the textbook dense GLS covariance; a block of marginals of unequal variances (with a 3-way table
    and an invariant) is solved in closed form per residual (`estimation._block_variances`)."""
    variances, exact = gls_variances(tables, GEOGRAPHIES)
    _, expected = dense_gls(tables, noisy_for(tables))
    assert exact
    np.testing.assert_allclose(np.concatenate(variances), expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("extra", [CountTable("state_c", (level("state"), C), 7.0), CountTable("a", (A,), 2.5)])
def test_variances_are_an_upper_bound_where_attributes_link_levels(extra):
    tables = mixed() + [extra]
    variances, exact = gls_variances(tables, GEOGRAPHIES)
    _, expected = dense_gls(tables, noisy_for(tables))
    assert not exact
    got = np.concatenate(variances)
    assert np.all(got >= expected - 1e-9)
    assert np.any(got > expected + 1e-6)  # the bound is not the exact value here


def test_variances_match_the_spread_of_the_estimate_over_noise_draws():
    """Statistical: 3,000 draws; per table the mean empirical variance over cells vs the prediction."""
    tables = mixed()
    variances, _ = gls_variances(tables, GEOGRAPHIES)
    rng = np.random.default_rng(7)
    draws = 3000
    sums = [np.zeros(t.n_cells) for t in tables]
    for _ in range(draws):
        noisy = [rng.normal(0, np.sqrt(t.variance), t.n_cells) for t in tables]
        for s, e in zip(sums, generalised_least_squares(tables, noisy, GEOGRAPHIES)):
            s += e ** 2
    for t, s, v in zip(tables, sums, variances):
        ratio = (s / draws).mean() / v.mean()
        assert abs(ratio - 1) < 0.08, (t.name, ratio)  # a 30% wrong variance is far outside


def test_integer_step_at_or_below_raw_error_per_level():
    """Benchmark claim in small: on a noisy 4-level tree (Poisson counts, variance 16 per cell), the
    published nonnegative integers have per-level MSE below the raw measurements' at every level
    with enough cells to tell (the nation and 3 states are left to the benchmark)."""
    rng = np.random.default_rng(3)
    leaves = tuple(f"{s:02d}{c:03d}{t:03d}" for s in range(3) for c in range(40) for t in range(rng.integers(2, 30)))
    geo = GeographyDomain("geo", (("state", 2), ("county", 5), ("tract", 8)), leaves, "drop")
    names = ["nation", "state", "county", "tract"]
    tables = [CountTable(n, (Dimension("geo", n, geo.level_size(n)),), 16.0) for n in names]
    maps = [None] + [geo.parent_of(names[i], names[i - 1]) for i in range(1, 4)]
    truth = [rng.poisson(3.0, len(leaves))]
    for mapping, units in zip(maps[:0:-1], [120, 3, 1]):
        truth.insert(0, np.bincount(mapping, truth[0], units))
    errors = np.zeros((3, 4))
    for _ in range(5):
        noisy = [t + np.rint(rng.normal(0, 4, t.shape)) for t in truth]
        estimates = generalised_least_squares(tables, noisy, {"geo": geo})
        published = top_down_hierarchy([e.reshape(-1, 1) for e in estimates], maps)
        for k, values in enumerate((noisy, estimates, published)):
            errors[k] += [np.mean((np.ravel(v) - t) ** 2) for v, t in zip(values, truth)]
    raw, gls, final = errors
    assert np.all(final[2:] < raw[2:]) and np.all(gls[2:] < raw[2:])
    assert all(np.all(p >= 0) and np.issubdtype(p.dtype, np.integer) for p in published)
    for i in range(1, 4):
        np.testing.assert_array_equal(np.bincount(maps[i], published[i].ravel(), published[i - 1].size),
                                      published[i - 1].ravel())


@pytest.fixture(scope="module")
def published_release(tmp_path_factory):
    directory = tmp_path_factory.mktemp("estimate")
    spec_path = write_case(directory / "case", small_spec())
    return run_release(spec_path, key_file=directory / "k.key")


@pytest.fixture
def release(published_release, tmp_path):
    copy = tmp_path / "release"
    shutil.copytree(published_release.release_dir, copy)
    return copy


def test_release_publishes_gls_variances_and_verifies(published_release):
    plan, root = published_release.plan, published_release.release_dir
    predicted = estimate_variances(plan)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["manifest_version"] == MANIFEST_VERSION
    records = {t["name"]: t for t in manifest["tables"]}
    assert set(predicted.per_cell) == {"pop.nation", "pop.state", "pop.county", "pop.tract", "agesex.age-sex",
                                       "by_sex"}
    for name, expected in predicted.per_cell.items():
        column = pq.read_table(root / "tables" / f"{name}.parquet").column("gls_variance").to_numpy()
        np.testing.assert_allclose(column, expected)
        record = records[name]["estimate"]
        assert record["bound"] == ("exact" if predicted.exact else "upper bound")
        assert record["variance_max"] == pytest.approx(expected.max(), rel=1e-5)
        assert record["variance_max"] <= records[name]["expected_error"]["variance"] + 1e-9
    stated = [STEPS["hierarchy"] + CONSISTENCY_STATED, STEPS["marginals_joint"] + CONSISTENCY_STATED]
    assert [s["step"] for s in manifest["post_processing"]][:2] == stated
    assert verify_release(root).ok


def _rewrite_manifest(release, edit) -> None:
    path = release / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def test_verify_rejects_an_edited_variance_column(release):
    path = release / "tables" / "pop.tract.parquet"
    table = pq.read_table(path)
    index = table.column_names.index("gls_variance")
    table = table.set_column(index, "gls_variance", pa.array(table.column("gls_variance").to_numpy() / 2))
    pq.write_table(table, path)

    def rehash(manifest):
        for entry in manifest["files"]:
            if entry["path"] == "tables/pop.tract.parquet":
                entry.update(sha256=sha256_file(path), bytes=path.stat().st_size)
    _rewrite_manifest(release, rehash)
    problems = verify_release(release).problems
    assert any("pop.tract: 'gls_variance' differs" in p for p in problems), problems


def test_verify_rejects_an_edited_variance_record(release):
    _rewrite_manifest(release, lambda m: m["tables"][3]["estimate"].update(variance_max=0.5))
    problems = verify_release(release).problems
    assert any("estimate.variance_max" in p for p in problems), problems


def without_variance_columns(release) -> None:
    """The release's table files as version 1 wrote them (no gls_variance column), the manifest rehashed."""
    import pyarrow.csv as pacsv

    for path in sorted((release / "tables").glob("*.parquet")):
        table = pq.read_table(path)
        if "gls_variance" in table.column_names:
            table = table.drop_columns(["gls_variance"])
            pq.write_table(table, path, compression="zstd")
            pacsv.write_csv(table, path.with_suffix(".csv"))

    def rehash(manifest):
        for entry in manifest["files"]:
            path = release / entry["path"]
            entry.update(sha256=sha256_file(path), bytes=path.stat().st_size)
    _rewrite_manifest(release, rehash)


def as_version_one(manifest: dict) -> None:
    """What the same release's manifest said before the global estimate (version 1)."""
    manifest["manifest_version"] = 1
    for invariant in manifest["invariants"]:
        invariant["note"] = "true counts published exactly; the guarantee holds conditional on them"
    for table in manifest["tables"]:
        table.pop("estimate", None)
    from dprelease.pipelines.postprocessing import CONSISTENCY_STATED

    legacy = {STEPS[k]: LEGACY_STEPS[k] for k in LEGACY_STEPS}
    for step in manifest["post_processing"]:
        text = step["step"].replace(CONSISTENCY_STATED, "")
        step["step"] = legacy.get(text, text)


def test_version_one_manifests_still_verify(release):
    without_variance_columns(release)
    _rewrite_manifest(release, as_version_one)
    assert verify_release(release).ok, verify_release(release).problems


def test_a_newer_release_relabelled_version_one_fails(release):
    """Relabelling skips no check: the tables still carry the gls_variance column version 1 never wrote."""
    _rewrite_manifest(release, as_version_one)
    problems = verify_release(release).problems
    assert any("columns" in p and "gls_variance" in p for p in problems), problems


def test_version_one_manifest_must_state_the_steps_of_its_time(release):
    without_variance_columns(release)

    def stale(manifest):
        as_version_one(manifest)
        manifest["post_processing"][0]["step"] = STEPS["hierarchy"]
    _rewrite_manifest(release, stale)
    assert any("post_processing[0].step" in p for p in verify_release(release).problems)


def test_joint_fit_is_nonnegative_keeps_totals_and_is_closer_than_the_measurements():
    """The fit (the release's kernel, `transforms.units.joint.fit_joints`) is the weighted projection of the
    noisy margins onto the margins of nonnegative joints with the given totals, a convex set holding the
    truth: its weighted distance to the true margins is smaller; fitted to exact margins, it finds them."""
    from dprelease.transforms.units.joint import JointShape, JointTable, fit_joints

    rng = np.random.default_rng(11)
    units, sizes = 4, (6, 2, 5)
    truth = rng.poisson(rng.gamma(0.6, 3.0, (units,) + sizes)).astype(np.float64)
    totals = truth.reshape(units, -1).sum(axis=1)
    kept_axes = (((0, 1), 9.0), ((0, 2), 4.0), ((1, 2), 16.0))
    shape = JointShape(sizes, tuple(JointTable(f"t{i}", axes, v) for i, (axes, v) in enumerate(kept_axes)))

    def margins(joint):
        full = joint.reshape((units,) + sizes)
        return [full.sum(axis=tuple(1 + a for a in range(3) if a not in axes)).reshape(units, -1)
                for axes, _ in kept_axes]
    true_margins = margins(truth)
    noisy = [m + rng.normal(0, np.sqrt(v), m.shape) for m, (_, v) in zip(true_margins, kept_axes)]
    fitted = fit_joints(shape, totals, noisy, noisy, iterations=3000)
    assert np.all(fitted >= 0)
    np.testing.assert_allclose(fitted.sum(axis=1), totals)

    def distance(values):
        return sum(((v - m) ** 2).sum() / var for v, m, (_, var) in zip(values, true_margins, kept_axes))
    assert distance(margins(fitted)) < distance(noisy)
    exact = fit_joints(shape, totals, true_margins, true_margins, iterations=3000)
    for fitted_margin, margin in zip(margins(exact), true_margins):
        np.testing.assert_allclose(fitted_margin, margin, atol=0.05)


def test_joint_fit_keeps_every_unit_total_when_its_steps_underflow():
    """Measurements no joint with the total can meet (every cell of 21 tables far below the total), so the step
    grows until each table's factor is clipped at exp(-100) and their product underflows to 0: a step to an
    empty joint is never taken, whatever its loss (found by review: the fit returned 0 for a total of 10^6)."""
    import itertools

    from dprelease.transforms.units.joint import JointShape, JointTable, fit_joints

    k = 6
    tables = [JointTable(f"a{i}", (i,), 1.0) for i in range(k)] + \
        [JointTable(f"p{i}{j}", (i, j), 1.0) for i, j in itertools.combinations(range(k), 2)]
    shape = JointShape((2,) * k, tuple(tables))
    totals = np.array([10 ** 6, 10 ** 4, 0])
    noisy = [np.full((3, 2 ** len(t.axes)), 1e4) for t in tables]
    fitted = fit_joints(shape, totals, noisy, noisy, iterations=50)
    assert np.all(np.isfinite(fitted)) and np.all(fitted >= 0)
    np.testing.assert_allclose(fitted.sum(axis=1), totals, rtol=1e-9)


def test_verify_refuses_to_replan_over_the_cell_limit(release, monkeypatch):
    monkeypatch.setenv("DPRELEASE_MAX_CELLS", "5")
    problems = verify_release(release).problems
    assert any("over the limit of 5" in p for p in problems), problems


def test_plan_and_report_show_the_gls_standard_deviation(published_release, tmp_path):
    import subprocess
    import sys

    spec = write_case(tmp_path / "case", small_spec())
    plan = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "plan", str(spec)],
                          capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "200"})
    assert plan.returncode == 0 and "GLS std" in plan.stdout
    said = " ".join(plan.stdout.split())  # issue 30: what the estimate means for the user's tables, then how
    assert "every count table is published from one least-squares estimate" in said
    assert "computed globally" in said and "since the tables do not form a tree of geographic units" in said
    tract = estimate_variances(published_release.plan).per_cell["pop.tract"]
    assert f"{tract.max() ** 0.5:.3f}" in plan.stdout
    out = tmp_path / "report.html"
    report = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "report",
                             str(published_release.release_dir), "--out", str(out)], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    html = out.read_text()
    assert "GLS std dev" in html and f"{tract.min() ** 0.5:.3g}" in html  # three significant figures

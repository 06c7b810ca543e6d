"""The release after the noise as worker stages (`pipelines.dataflow`): run stage by stage, group by group,
they write exactly the files the embedded engine writes, whole-table or in parts; pieces survive their
byte encoding; the driver refuses files a worker reported but it cannot see."""
from __future__ import annotations

import numpy as np
import pytest

from dprelease.accounting.errors import DPReleaseError
from dprelease.pipelines.dataflow import (STAGE_CODES, Flow, Piece, from_table, noise_piece, pack, range_length,
                                          run_local, split, stage_groups, stage_order, stage_sources, to_batch,
                                          unpack)
from dprelease.pipelines import dataflow
from dprelease.pipelines.layout import Layout
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.postprocessing import post_process
from dprelease.pipelines.provenance import Invocation
from dprelease.pipelines.release import check_staged_files, finish_release, new_staging, stage_release
from dprelease.pipelines.spec import parse_spec

from .conftest import small_spec, write_case
from .test_units import COLUMNS, geography

QUERIES = [
    {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county", "tract"]},
    {"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race"], "way": 2, "within": "geo.county"},
    {"name": "h", "kind": "histogram", "by": ["geo.county", "smoker", "age"]},
    {"name": "total", "kind": "sum", "column": "income", "by": ["geo.tract"]},
    {"name": "avg", "kind": "mean", "column": "income", "by": ["sex"]},
    {"name": "med", "kind": "quantile", "column": "income", "q": [0.5, 0.25], "candidates": [0, 10, 100, 1000],
     "by": ["geo.county"]},
]
FLOW_COLUMNS = {**COLUMNS, "income": {"type": "integer", "min": 0, "max": 10**5, "clamp": [0, 1000]},
                "smoker": {"type": "categorical", "values": ["no", "yes", "quit"], "on_invalid": "drop",
                           "randomized_response": {"epsilon": "1/2"}}}
COMMON = dict(engine="embedded", key_id="0" * 16, created_at="2026-01-01T00:00:00+00:00",
              invocation=Invocation("test"))


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    spec = small_spec(columns=FLOW_COLUMNS, queries=QUERIES, budget={"definition": "zcdp", "rho": "1/3"})
    directory = tmp_path_factory.mktemp("dataflow")
    path = write_case(directory, spec)
    (directory / "geo.txt").write_text("\n".join(geography(8)) + "\n")
    return build_plan(parse_spec(spec), path.parent)


def noisy_outputs(plan) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {t.name: (rng.integers(0, 4, t.n_outputs) * 10 if t.quantiles else rng.integers(-5, 60, t.n_outputs))
            .astype(np.int64) for t in plan.tables}


def noise_pieces(flow: Flow, noisy: dict[str, np.ndarray]) -> list[Piece]:
    """The noisy values in the ranges a distributed engine's noise stage emits."""
    pieces = []
    for i, t in enumerate(flow.plan.tables):
        step = range_length(flow, i) // (t.layout.buckets if t.quantiles else 1) * max(1, len(t.quantiles))
        for start in range(0, t.n_outputs, step):
            pieces.append(noise_piece(flow, i, start, noisy[t.name][start:start + step]))
    return pieces


def files_of(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("layout, piece_bytes", [(Layout(), None), (Layout(64, 64), None), (Layout(64, 64), 256)],
                         ids=["whole tables", "parts", "parts in small pieces"])
def test_stages_write_the_embedded_release_byte_for_byte(plan, tmp_path, layout, piece_bytes, monkeypatch):
    """Also with every row between stages cut to a few units (`dataflow.MAX_PIECE_BYTES`)."""
    if piece_bytes:
        monkeypatch.setattr(dataflow, "MAX_PIECE_BYTES", piece_bytes)
    noisy = noisy_outputs(plan)
    embedded = stage_release(plan, noisy, post_process(plan, noisy, group_work=layout.group_work),
                             tmp_path / "embedded" / "r", layout=layout, **COMMON)
    staging, token = new_staging(tmp_path / "stages" / "r")
    flow = Flow(plan, layout, str(staging), staging_token=token)
    entries, summaries = run_local(flow, noise_pieces(flow, noisy))
    check_staged_files(staging, entries)
    staged = finish_release(plan, staging, entries, layout=layout, summaries=summaries, **COMMON)
    ours, reference = files_of(staged.staging), files_of(embedded.staging)
    assert ours.keys() == reference.keys()
    assert all(ours[name] == reference[name] for name in reference)
    parts = [name for name in reference if "part-" in str(name)]
    assert bool(parts) == (layout.group_work == 64)
    assert any(str(name).startswith("debiased/h") for name in reference)  # the randomized column's table


def test_a_large_piece_travels_as_pieces_of_whole_units_that_join_back():
    arrays = {"block": np.arange(40.0).reshape(10, 4), "own_total": np.arange(10.0).reshape(10, 1)}
    piece = Piece(7, "up", 2, 100, 10, arrays)
    parts = dataflow.bounded(piece, 3 * 5 * 8)
    assert [(p.start, p.count) for p in parts] == [(100, 3), (103, 3), (106, 3), (109, 1)]
    assert {p.key for p in parts} == {7}
    back = from_table(dataflow.to_batch(parts[::-1]))
    first, joined = dataflow._join(back, "up", 2)
    assert first == 100 and all(np.array_equal(joined[n], arrays[n]) for n in arrays)


def test_stages_read_only_the_pools_that_feed_them(plan):
    """Groups of 64 cells: the leaves' up step runs with the one above it, the root's steps with down(1) (each of one
    group); the per-cell parts run in the first stage."""
    flow = Flow(plan, Layout(64, 64), "")
    stages = stage_order(flow)
    up, down = STAGE_CODES["up"] << 16, STAGE_CODES["down"] << 16
    assert flow.runs == [(up | 3, up | 2), (up | 1,), (up | 0, down | 0, down | 1), (down | 2,), (down | 3,)]
    assert stages[0][:2] == [up | 3, up | 2] and {p >> 16 for p in stages[0][2:]} == {3, 4, 5}
    assert stages[1:] == [[up | 1], [up | 0, down | 0, down | 1], [down | 2], [down | 3]]
    sources = stage_sources(flow, stages)
    assert sources[0] == [0]            # the leaves' and the per-cell parts: noise only (pool i + 1: stage i's output)
    assert sources[1] == [0, 1]         # up(1): noise and up(2) (the first stage's)
    assert sources[2] == [0, 2]         # the root's run: noise and up(1)
    assert sources[3] == [0, 1, 3]      # down(2): noise, up(2) (the first stage's) and down(1) (the root's run's)
    assert sources[4] == [0, 1, 4]      # down(3): noise, up(3) (the first stage's) and down(2)
    assert stage_groups(flow, stages[2]) == 1 and stage_groups(flow, stages[0]) == 1 + sum(
        stage_groups(flow, [p]) for p in stages[0][2:])
    whole = Flow(plan, Layout(), "")    # every step of one group: the whole tree is one run, in one stage
    assert len(whole.runs) == 1 and len(stage_order(whole)) == 1


@pytest.fixture(scope="module")
def leaf_plan(tmp_path_factory):
    """Marginals within tract: the leaves' groups of 64 cells are many, so the fused leaves' run has many groups."""
    queries = [QUERIES[0], {**QUERIES[1], "within": "geo.tract"}, QUERIES[3]]
    spec = small_spec(columns=FLOW_COLUMNS, queries=queries, budget={"definition": "zcdp", "rho": "1/3"})
    directory = tmp_path_factory.mktemp("leaves")
    path = write_case(directory, spec)
    (directory / "geo.txt").write_text("\n".join(geography(8)) + "\n")
    return build_plan(parse_spec(spec), path.parent)


@pytest.mark.parametrize("piece_bytes", [None, 256])
def test_a_run_of_many_groups_writes_the_embedded_release_byte_for_byte(leaf_plan, tmp_path, piece_bytes, monkeypatch):
    """The leaves' up step and the one above it share their groups (many here): one stage, group for group, the
    same bytes as the embedded engine; a group's pieces for the step after it never leave the group."""
    if piece_bytes:
        monkeypatch.setattr(dataflow, "MAX_PIECE_BYTES", piece_bytes)
    layout = Layout(64, 64)
    noisy = noisy_outputs(leaf_plan)
    embedded = stage_release(leaf_plan, noisy, post_process(leaf_plan, noisy, group_work=layout.group_work),
                             tmp_path / "embedded" / "r", layout=layout, **COMMON)
    staging, token = new_staging(tmp_path / "stages" / "r")
    flow = Flow(leaf_plan, layout, str(staging), staging_token=token)
    up = STAGE_CODES["up"] << 16
    assert flow.runs[0] == (up | 3, up | 2) and stage_groups(flow, [up | 3]) > 3
    routed = [p for piece in noise_pieces(flow, noisy) for p in dataflow.route_noise(flow, piece)]
    first = [p for p in routed if dataflow.stage_of(p.key) in flow.runs[0]]
    groups = {dataflow.group_key(flow.heads, p.key) for p in first}
    assert len(groups) == stage_groups(flow, [up | 3])
    out = [made for g in sorted(groups) for made in dataflow.run_group(
        flow, g, [p for p in first if dataflow.group_key(flow.heads, p.key) == g])]
    assert out and not any(dataflow.stage_of(p.key) == up | 2 for p in out if p.kind != dataflow.FILES)
    entries, summaries = run_local(flow, noise_pieces(flow, noisy))
    check_staged_files(staging, entries)
    staged = finish_release(leaf_plan, staging, entries, layout=layout, summaries=summaries, **COMMON)
    ours, reference = files_of(staged.staging), files_of(embedded.staging)
    assert ours.keys() == reference.keys() and all(ours[name] == reference[name] for name in reference)


def test_pieces_survive_their_encoding_and_split_at_group_bounds():
    arrays = {"values": np.arange(12, dtype=np.int64).reshape(6, 2), "weights": np.linspace(0, 1, 6),
              "flag": np.array(True)}
    assert all(np.array_equal(a, b) for a, b in zip(unpack(pack(arrays)).values(), arrays.values()))
    piece = Piece(0, "noise", 2, 10, 6, arrays)
    back = from_table(to_batch([piece]))[0]
    assert (back.kind, back.level, back.start, back.count) == ("noise", 2, 10, 6)
    cut = split(piece, np.array([0, 12, 13, 100]))
    assert [(p.key, p.start, p.count) for p in cut] == [(0, 10, 2), (1, 12, 1), (2, 13, 3)]
    assert np.array_equal(np.concatenate([p.arrays["values"] for p in cut]), arrays["values"])


def test_driver_refuses_files_it_cannot_see(tmp_path):
    staging, _ = new_staging(tmp_path / "r")
    (staging / "a.csv").write_bytes(b"x,y\n")
    check_staged_files(staging, [{"path": "a.csv", "sha256": "0" * 64, "bytes": 4}])
    with pytest.raises(DPReleaseError, match="storage every worker shares"):
        check_staged_files(staging, [{"path": "b.csv", "sha256": "0" * 64, "bytes": 4}])
    with pytest.raises(DPReleaseError, match="storage every worker shares"):
        check_staged_files(staging, [{"path": "a.csv", "sha256": "0" * 64, "bytes": 5}])
    with pytest.raises(DPReleaseError, match="twice"):
        check_staged_files(staging, [{"path": "a.csv", "sha256": "0" * 64, "bytes": 4}] * 2)


# ---- verify streams a partitioned release ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parted(tmp_path_factory):
    """The demo release written in parts of 64 units (as the distributed engines write it)."""
    from dprelease.pipelines.commands import demo_data
    from dprelease.pipelines.run import run_release

    from .conftest import DEMO_SPEC

    root = tmp_path_factory.mktemp("parted")
    data, _ = demo_data(20_000, root / "data", seed=5)
    return run_release(DEMO_SPEC, input_path=str(data), out_dir=root / "out", key_file=root / "k.key",
                       layout=Layout(64, 64)).release_dir


@pytest.fixture
def parted_copy(parted, tmp_path):
    import shutil

    copy = tmp_path / "demo-2026"
    shutil.copytree(parted, copy)
    return copy


def test_verify_streams_a_partitioned_release_a_range_of_units_at_a_time(parted, monkeypatch):
    """Chunks of 100 cells cross every part boundary; tables over the cell cap still verify (verify holds a
    range of units, not a table); --recompute, which holds the release, keeps the cap."""
    from dprelease.pipelines import verify_tables
    from dprelease.pipelines.verify import verify_release

    assert len(list(parted.glob("tables/*/part-*.parquet"))) > 10
    monkeypatch.setattr(verify_tables, "CHUNK_CELLS", 100)
    monkeypatch.setenv("DPRELEASE_MAX_CELLS", "1000")
    report = verify_release(parted)
    assert report.ok, report.problems
    recomputed = verify_release(parted, recompute=True)
    assert any("over the limit" in p for p in recomputed.problems)


@pytest.mark.parametrize("table, expected", [("population.tract", "does not add up"),
                                             ("county_marginals.age-sex", "unit totals")])
def test_streaming_verify_finds_an_edit_in_one_part(parted_copy, table, expected):
    """One cell +1 in the last part of a partitioned table (files rehashed): the check that reads the
    units of that part finds it."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from dprelease.pipelines.verify import verify_release

    from .test_hostile_releases import rehash, set_column

    last = sorted((parted_copy / "tables" / table).glob("part-*.parquet"))[-1]
    data = pq.read_table(last)
    counts = data.column("count").to_numpy().copy()
    counts[-1] += 1
    data = set_column(data, "count", counts)
    pq.write_table(data, last)
    pacsv.write_csv(data, last.with_suffix(".csv"))
    rehash(parted_copy)
    problems = verify_release(parted_copy).problems
    assert any(expected in p for p in problems), problems


def test_a_geography_domain_travels_without_its_cache_and_its_tables_share_one_lookup(plan):
    """Every table of a level reads one read-only lookup (leaf -> unit), so a pickled plan holds it once; the domain's
    cache (derived units and lookups) never travels: a worker makes it again, the same."""
    import pickle

    geo = plan.domains["geo"]
    lookups = [t.layout.lookups[0] for t in plan.tables if t.layout.columns[:1] == ("geo",)
               and t.dims[0].level == "county"]
    assert len(lookups) > 1 and all(lookup is lookups[0] for lookup in lookups) and not lookups[0].flags.writeable
    geo.units("tract")
    arrived = pickle.loads(pickle.dumps(geo))
    assert arrived._cache == {} and arrived == geo
    assert np.array_equal(arrived.leaf_to_level("county"), geo.leaf_to_level("county"))
    assert len(pickle.dumps(geo)) == len(pickle.dumps(arrived))


def test_a_beam_worker_unpickles_only_the_plan_file_its_launcher_wrote(plan, tmp_path, monkeypatch):
    """The plan and the tree travel once, as a file in the run's result directory; a worker reads it once per
    process and refuses bytes whose SHA-256 is not the one the transforms carry (nothing else is unpickled)."""
    pytest.importorskip("apache_beam")
    from dprelease.pipelines.engines import beam as beam_engine

    flow = Flow(plan, Layout(64, 64), str(tmp_path / "staging"))
    token = ("test", 64, 64, str(tmp_path / "staging"), "t")
    monkeypatch.setattr(dataflow, "_FLOWS", {})
    shipped = beam_engine._ship_flow(flow, str(tmp_path))
    assert shipped[0] == str(tmp_path / "flow.pickle")
    arrived = beam_engine._shipped_flow(token, shipped)
    assert arrived.runs == flow.runs and arrived.plan.tables[0].name == plan.tables[0].name
    (tmp_path / "flow.pickle").unlink()
    assert beam_engine._shipped_flow(token, shipped) is arrived  # once per process: not read again
    dataflow._FLOWS.clear()
    (tmp_path / "flow.pickle").write_bytes(b"not the launcher's")
    with pytest.raises(DPReleaseError, match="changed after the launcher wrote it"):
        beam_engine._shipped_flow(token, shipped)

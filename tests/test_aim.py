"""`select: aim` marginals: AIM-style adaptive rounds accounted before any data is read, each round chosen
against the model of the tables released so far, the junction tree of chosen tables recorded in the manifest
and checked by verify, post-processed into tables that add up, drawn from by `synthesize`, and the same on
Spark and Beam."""
from __future__ import annotations

import itertools
import json
import os
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines.manifest import MANIFEST_VERSION
from dprelease.pipelines.plan import build_plan, with_selections
from dprelease.pipelines.spec import load_spec
from dprelease.transforms.aim import (attribute_weights, clique_steps, clique_weight, junction_steps, largest_weight,
                                      model_estimates, round_candidates)

from .conftest import small_spec, write_case
from .test_mst import ATTRIBUTES, assert_same_selection_and_release, cli, dependent_people, run_with_ledger


def aim_case(directory, budget=None, neighbouring="add_remove", people: int = 600, **query):
    """600 people; income follows education closely, so (edu, inc) is the table worth measuring first."""
    rows, columns = dependent_people(np.random.default_rng(3), people)
    spec = small_spec(budget=budget or {"definition": "zcdp", "rho": 50, "delta": 1e-9}, neighbouring=neighbouring)
    spec["columns"].update(columns)
    spec["queries"] = [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county", "tract"]},
        {"name": "m", "kind": "marginals", "attributes": ATTRIBUTES, "within": "geo.state", "select": "aim", **query}]
    return write_case(directory, spec, rows)


def test_round_candidates_grow_a_junction_tree_one_attribute_at_a_time():
    attributes = ["a", "b", "c", "d"]
    assert round_candidates(attributes, [], 2) == [(("a",), "b"), (("a",), "c"), (("a",), "d"), (("b",), "c"),
                                                   (("b",), "d"), (("c",), "d")]
    second = round_candidates(attributes, [("b", "d")], 2)
    assert second == [(("b",), "a"), (("b",), "c"), (("d",), "a"), (("d",), "c"), (("b", "d"), "a"),
                      (("b", "d"), "c")]
    assert round_candidates(attributes, [("b", "d")], 1) == second[:4]  # degree 1: single separators only
    cliques = [("b", "d"), ("a", "b", "d"), ("a", "c")]
    assert junction_steps(attributes, cliques, 2) == [(("b",), "d"), (("b", "d"), "a"), (("a",), "c")]
    assert clique_steps(cliques) == junction_steps(attributes, cliques, 2)
    for wrong, problem in (([("b", "d"), ("a", "b", "d")], "has 3"),
                           ([("a", "b", "d"), ("b", "c"), ("c", "d")], "must be a pair"),
                           ([("b", "d"), ("a", "c"), ("c", "d")], "must add one new attribute"),
                           ([("b", "d"), ("a", "b"), ("a", "c", "d")], "lies inside no earlier clique"),
                           ([("b", "d"), ("a", "b", "d"), ("a", "b", "c", "d")], "1 to 2 attributes"),
                           ([("d", "b"), ("a", "b"), ("a", "c")], "in its order")):
        with pytest.raises(ValueError, match=problem):
            junction_steps(attributes, wrong, 2)


def test_cycle_rounds_offer_every_table_within_the_models_cap(monkeypatch):
    """Over a capped model every table not chosen is a candidate while the model of the tables so far and it stays
    within the cap (tried every round, by the model the round's fit would triangulate); verify accepts a recorded
    selection only if the rounds could have made it."""
    from dprelease.transforms import aim_model

    attributes = ["a", "b", "c", "d"]
    sizes = dict.fromkeys(attributes, 3)
    candidates = aim_model.all_candidates(attributes, 2)
    assert len(candidates) == 6 + 4 and aim_model.cycle_rounds(attributes, candidates) == 6
    assert aim_model.cycle_rounds(["a", "b"], aim_model.all_candidates(["a", "b"], 1)) == 1  # at most the candidates
    chosen = [("a", "b"), ("b", "c"), ("c", "d")]
    offered = aim_model.round_candidates(attributes, candidates, chosen, sizes, 1)
    assert ("a", "d") in offered and len(offered) == 7  # (a, d) closes the 4-cycle: two triangles, 54 cells
    with monkeypatch.context() as patched:
        patched.setattr(aim_model, "MODEL_CELLS", 40)  # one triangle and a pair: 36 cells; two triangles: 54
        offered = aim_model.round_candidates(attributes, candidates, chosen, sizes, 1)
        assert offered == [("a", "c"), ("b", "d"), ("a", "b", "c"), ("b", "c", "d")]
        # after (a, c) and (a, b, c) nothing else fits: the selection may end after 5 of its 6 rounds
        aim_model.check_chosen(attributes, candidates, chosen + [("a", "c"), ("a", "b", "c")], 6, sizes, 1)
        with pytest.raises(ValueError, match=r"4 tables chosen and the rounds' budget \(6\) not spent, but 1 "
                                             r"candidates \(such as \['a', 'b', "):
            aim_model.check_chosen(attributes, candidates, chosen + [("a", "c")], 6, sizes, 1)  # (a, b, c) was left
        with pytest.raises(ValueError, match="is chosen twice"):
            aim_model.check_chosen(attributes, candidates, chosen + [("a", "b")], 6, sizes, 1)
        with pytest.raises(ValueError, match="is not a candidate"):
            aim_model.check_chosen(attributes, candidates, [("b", "a")], 6, sizes, 1)
        with pytest.raises(ValueError, match="over the cap"):
            aim_model.check_chosen(attributes, candidates, chosen + [("a", "d")], 6, sizes, 1)
    with pytest.raises(ValueError, match="4 tables chosen; the selection has 3 rounds"):
        aim_model.check_chosen(attributes, candidates, chosen + [("a", "c")], 3, sizes, 1)
    # version 9: only tables the model so far reads within READ_CELLS (a carried a with the separators b, c: 9)
    with monkeypatch.context() as patched:
        patched.setattr(aim_model, "READ_CELLS", 9)
        assert len(aim_model.round_candidates(attributes, candidates, chosen, sizes, 1, bounded_reads=True)) == 7
        assert aim_model.round_candidates(attributes, candidates, chosen, sizes, 17, bounded_reads=True) == []
        assert len(aim_model.round_candidates(attributes, candidates, chosen, sizes, 16, bounded_reads=True)) == 7
        patched.setattr(aim_model, "READ_CELLS", 8)  # (c, d) after (a, b), (b, c): d carried across b, 9 cells
        assert ("c", "d") in aim_model.round_candidates(attributes, candidates, chosen[:2], sizes, 1)
        assert ("c", "d") not in aim_model.round_candidates(attributes, candidates, chosen[:2], sizes, 1,
                                                            bounded_reads=True)
        aim_model.check_chosen(attributes, candidates, chosen, 3, sizes, 1)
        with pytest.raises(ValueError, match=r"table \['c', 'd'\] is read from the model of the tables before it "
                                             r"with 9 cells per unit over 1 units, over the cap \(8 per unit"):
            aim_model.check_chosen(attributes, candidates, chosen, 3, sizes, 1, bounded_reads=True)


def test_workload_weights_are_aims_per_attribute_and_the_largest_candidate_bounds_them():
    attributes = ["a", "b", "c", "d"]
    assert attribute_weights(attributes, None) == {} and clique_weight({}, ("a", "b", "c")) == 1
    weights = attribute_weights(attributes, [(("a", "b"), 2), (("b", "c"), 4), (("d",), 2)])
    assert weights == {"a": 1, "b": 3, "c": 2, "d": 1}  # 2, 6, 4, 2 over their gcd 2
    # AIM's w_r = sum over the workload of weight * |r & s|: (a, b, c) shares 2 with (a, b), 2 with (b, c)
    assert clique_weight(weights, ("a", "b", "c")) * 2 == 2 * 2 + 4 * 2 + 2 * 0
    assert largest_weight(weights, 2) == 6 and largest_weight(weights, 1) == 5 and largest_weight({}, 2) == 1


@pytest.mark.parametrize("definition", ["pure", "zcdp"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace"])
def test_the_plan_accounts_every_round_before_any_data_is_read(tmp_path, definition, neighbouring, monkeypatch):
    from dprelease.pipelines.plan import SelectionError, selection_shape
    from dprelease.transforms import aim_model
    from dprelease.transforms.units.graphical import model_cells

    budget = {"definition": "pure", "epsilon": 2} if definition == "pure" else \
        {"definition": "zcdp", "rho": "1/2", "delta": 1e-9}
    spec, base = load_spec(aim_case(tmp_path / "c", budget, neighbouring))
    share = Fraction(1, 2) * build_plan(spec, base).allocation_budget
    # manifest version 7 or earlier: a junction tree grown one attribute a round, attributes - 1 rounds
    plan = build_plan(spec, base, aim_cycles=False)
    [selection] = plan.selections
    assert selection.method == "aim" and selection.degree == 2 and selection.rounds == 3 and not selection.cycles
    assert len(selection.candidates) == 6 + 4 and plan.pending  # every pair and triple a round could choose
    assert selection.event.allocated == share / 10 and selection.pair_event.allocated == share * Fraction(9, 20) / 3
    assert selection.event.sensitivity.l1 == (2 if neighbouring == "replace" else 1)
    chosen = with_selections(plan, {"m": (("edu", "inc"), ("sex", "edu", "inc"), ("age", "sex"))})
    assert not chosen.pending and (chosen.totals.pure_epsilon, chosen.totals.rho) == (plan.totals.pure_epsilon,
                                                                                       plan.totals.rho)
    assert chosen.table("m.sex-edu-inc").event.mechanism == selection.pair_event.mechanism
    # version 8: over a capped model, twice the rounds (cycles allowed), each chosen table a sixth of the share
    plan = build_plan(spec, base, aim_annealing=False)
    [selection] = plan.selections
    assert selection.cycles and selection.rounds == 6 and selection.unused_rounds == 6 and not selection.annealing
    assert selection.pair_event.allocated == share * Fraction(9, 20) / 6
    cyclic = (("edu", "inc"), ("sex", "edu"), ("sex", "inc"), ("age", "sex", "edu"), ("age", "edu"), ("age", "sex"))
    chosen = with_selections(plan, {"m": cyclic})  # edu-inc-sex closes a cycle
    assert chosen.table("m.sex-inc").event.mechanism == selection.pair_event.mechanism
    assert (chosen.totals.pure_epsilon, chosen.totals.rho) == (plan.totals.pure_epsilon, plan.totals.rho)
    with pytest.raises(SelectionError, match=r"4 tables chosen and the rounds' budget \(6\) not spent, but 6 cand"):
        with_selections(plan, {"m": cyclic[:4]})  # a selection ends early only when no candidate is left
    sizes, units = selection_shape(plan.query("m"), plan.domains)
    with monkeypatch.context() as patched:  # a cap only (sex, inc), the smallest table, fits: nothing after it
        patched.setattr(aim_model, "MODEL_CELLS", model_cells(ATTRIBUTES, [(a,) for a in ATTRIBUTES] + [("sex", "inc")],
                                                              sizes))
        early = with_selections(plan, {"m": (("sex", "inc"),)})
    [made] = early.selections
    assert made.unused_rounds == 5 and sum(e.allocated for e in early.events()) == plan.allocation_budget
    assert (early.totals.pure_epsilon, early.totals.rho) == (plan.totals.pure_epsilon, plan.totals.rho)
    done = cli("plan", str(tmp_path / "c" / "spec.yaml"), "--json")
    records = {r["table"]: r for r in json.loads(done.stdout)["tables"]}
    assert records["m.selection"]["statistic"] == "aim selection" and "m.<up to 6 tables chosen>" in records
    # version 9: the same plan before data, its 6 rounds budget units a round may spend several of (annealing)
    plan = build_plan(spec, base)
    [selection] = plan.selections
    assert selection.annealing and selection.rounds == 6 and selection.growth == (2 if definition == "pure" else 4)
    equal = build_plan(spec, base, aim_annealing=False).totals  # version 8: its rounds' realized (rounded) losses
    loss = (lambda totals: totals.pure_epsilon if definition == "pure" else totals.rho)
    assert loss(equal) <= loss(plan.totals) <= plan.allocation_budget  # the filter's bound: the allocation
    annealed = with_selections(plan, {"m": cyclic[:5]}, {"m": (1, 1, 1, 1, 2)})  # the last round: both units left
    [made] = annealed.selections
    assert made.units == (1, 1, 1, 1, 2) and made.unused_rounds == 0
    last = annealed.table("m.age-edu").event
    assert last.allocated == 2 * selection.pair_event.allocated and \
        last.mechanism.variance() < selection.pair_event.mechanism.variance() / 1.99
    assert made.round_selection(2).mechanism.epsilon >= selection.event.mechanism.epsilon * \
        Fraction(2 if definition == "pure" else 141, 1 if definition == "pure" else 100)  # 2 or about sqrt(2) times
    # each round's mechanisms lose at most their units' share (rounded: the rounds' losses can sum to more than the
    # rounded plan's); the ledger charges the selection's allocation, the same before and after it
    assert annealed.ledger_spend() == plan.ledger_spend() and annealed.totals == plan.totals
    assert annealed.ledger_spend()[1] >= (annealed.totals.pure_epsilon or annealed.totals.rho)
    assert sum(e.allocated for e in annealed.events()) == plan.allocation_budget
    for units, expected in (((1, 1, 1, 1, 3), r"round 5 has 3 budget units; after \[1, 1, 1, 1\] of 6 the rounds "
                                                r"allow \[1, 2\]"),
                            ((2, 1, 1, 1, 1), r"round 1 has 2 budget units"),
                            ((1, 1, 1, 1), r"5 tables chosen, but the rounds' budget units are \(1, 1, 1, 1\)"),
                            ((1, 1, 1, 1, 0), "are not all positive integers")):
        with pytest.raises(SelectionError, match=expected):
            with_selections(plan, {"m": cyclic[:5]}, {"m": units})
    with pytest.raises(SelectionError, match=r"4 tables chosen and the rounds' budget \(6\) not spent, but 6 cand"):
        with_selections(plan, {"m": cyclic[:4]}, {"m": (1, 1, 1, 1)})  # 2 units left: only when nothing fits
    with pytest.raises(SelectionError, match="budget units are recorded, but its rounds are not annealed"):
        build_plan(spec, base, chosen={"m": cyclic}, units={"m": (1,) * 6}, aim_annealing=False)


@pytest.mark.parametrize("definition", ["pure", "zcdp"])
def test_annealed_rounds_never_spend_more_than_the_plan_whatever_they_decide(tmp_path, definition):
    """The privacy filter of AIM's annealing: every sequence of anneal decisions (an adversary's choice: the
    decisions are functions of released values the data shapes) gives rounds whose units sum to the budget at
    most, each accepted by verify's check; every plan of such rounds composes to at most the plan's loss, and the
    selection's draws and measurements are calibrated to their units' shares."""
    from dprelease.accounting.composition import compose
    from dprelease.transforms import aim_model

    for growth in (2, 4):
        for budget in range(1, 13):
            for decisions in itertools.product((False, True), repeat=budget):
                spent: list[int] = []
                for annealed in decisions:
                    units = aim_model.next_units(spent, budget, annealed, growth)
                    if units == 0:
                        break
                    spent.append(units)
                assert sum(spent) == budget and all(u >= 1 for u in spent)
                aim_model.check_units(spent, budget, growth)
                with pytest.raises(ValueError):
                    aim_model.check_units(spent + [1], budget, growth)  # nothing after the budget is spent
    budget = {"definition": "pure", "epsilon": 2} if definition == "pure" else \
        {"definition": "zcdp", "rho": "1/2", "delta": 1e-9}
    spec, base = load_spec(aim_case(tmp_path / "c", budget))
    plan = build_plan(spec, base)
    [selection] = plan.selections
    cyclic = (("edu", "inc"), ("sex", "edu"), ("sex", "inc"), ("age", "sex", "edu"), ("age", "edu"), ("age", "sex"))
    seen = set()
    for decisions in itertools.product((False, True), repeat=selection.rounds):
        spent: list[int] = []
        for annealed in decisions:
            units = aim_model.next_units(spent, selection.rounds, annealed, selection.growth)
            if units == 0:
                break
            spent.append(units)
        if tuple(spent) in seen:
            continue
        seen.add(tuple(spent))
        made = with_selections(plan, {"m": cyclic[:len(spent)]}, {"m": tuple(spent)})
        stated = made.totals.pure_epsilon if definition == "pure" else made.totals.rho
        realized = compose([t.event for t in made.measured()] + made.selections[0].events(), made.definition,
                           made.delta)  # this sequence's own (rounded) losses
        assert (realized.pure_epsilon or realized.rho) <= stated <= plan.allocation_budget
        assert made.totals == plan.totals and made.ledger_spend() == plan.ledger_spend()
        assert sum(e.allocated for e in made.events()) == plan.allocation_budget
        for clique, units in zip(cyclic, spent):  # the noise the rounds drew is the noise the release accounts
            event = made.table(f"m.{'-'.join(clique)}").event
            assert event.allocated == units * selection.pair_event.allocated and event.loss <= event.allocated
            assert selection.round_measurement(units, event.table) == event
    assert len(seen) > 3


def test_an_aim_release_runs_verifies_adds_up_and_synthesizes(tmp_path, monkeypatch):
    from dprelease.pipelines.verify import verify_release
    from dprelease.transforms import aim_model

    root, manifest, ledger = run_with_ledger(tmp_path, aim_case(tmp_path / "c"))
    [record] = manifest["selections"]
    assert manifest["manifest_version"] == MANIFEST_VERSION and record["method"] == "aim" and record["degree"] == 2
    assert record["chosen"][0] == ["edu", "inc"]  # by far the most dependent pair
    assert len(record["chosen"]) == len(record["units"]) and record["rounds"] == 6
    assert sum(record["units"]) + record["unused_units"] == 6 and record["units"][0] == 1
    with pytest.raises(ValueError):  # the tables close cycles: no junction tree grown one attribute a round
        junction_steps(ATTRIBUTES, [tuple(c) for c in record["chosen"]], 2)
    assert "close cycles" in record["candidates_rule"]
    names = [f"m.{'-'.join(c)}" for c in record["chosen"]]
    assert set(names) | {f"m.{a}" for a in ATTRIBUTES} <= {t["name"] for t in manifest["tables"]}
    for args in ([], ["--recompute"], ["--ledger", str(ledger)]):  # --recompute decides the units again
        checked = cli("verify", str(root), *args)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    with monkeypatch.context() as patched:  # rounds that had annealed otherwise are told apart
        patched.setattr(aim_model, "anneals", lambda before, after, sigma: True)
        problems = verify_release(root, recompute=True).problems
    assert any("the rounds' budget units decided again from measurements/ are [1, 5]" in p for p in problems), problems
    tables = {n: pq.read_table(root / "tables" / f"{n}.parquet").to_pandas() for n in names}
    one_way = {a: pq.read_table(root / "tables" / f"m.{a}.parquet").to_pandas() for a in ATTRIBUTES}
    for clique, name in zip(record["chosen"], names):  # every chosen table's margins are the 1-way tables
        assert (tables[name]["count"] >= 0).all()
        for attribute in clique:
            margin = tables[name].groupby(["state", attribute], sort=False)["count"].sum().reset_index()
            joined = one_way[attribute].merge(margin, on=["state", attribute], suffixes=("", "_table"))
            assert (joined["count"] == joined["count_table"]).all() and len(joined) == len(one_way[attribute])
    out = tmp_path / "synthetic.parquet"
    synthesized = cli("synthesize", str(root), "--out", str(out))
    assert synthesized.returncode == 0, synthesized.stderr
    said = " ".join(synthesized.stdout.split())
    assert "pop." not in said.partition("Not reproduced")[2].partition("Utility")[0]  # the hierarchy is exact
    records = pq.read_table(out).to_pandas()
    state = pq.read_table(root / "tables" / "pop.state.parquet").to_pandas()
    assert len(records) == int(state["count"].sum())
    assert "Not reproduced" not in said, said  # drawn from the release's own integer clique tables
    for clique, name in zip(record["chosen"], names):  # so the records reproduce every chosen table exactly
        tabulated = records.groupby(["state", *clique]).size()
        published = tables[name].set_index(["state", *clique])["count"]
        assert tabulated.reindex(published.index, fill_value=0).tolist() == published.tolist(), clique


def test_records_of_a_cyclic_aim_model_under_a_by_hierarchy_whose_totals_differ_come_from_a_refit(tmp_path,
                                                                                                      monkeypatch):
    """A hierarchy crossed with `by` publishes its own unit totals; where they differ from the aim query's (each
    made integral on its own), the release's clique tables cannot give the hierarchy's number of records, so
    `synthesize` fits a model to the published tables instead (`_aim_model_records`' fallback): the records number
    the hierarchy's totals and follow every chosen table up to that fit."""
    from dprelease.pipelines import synthesize as synthesize_module
    from dprelease.pipelines.run import run_release
    from dprelease.transforms.units import graphical

    rows, columns = dependent_people(np.random.default_rng(3), 600)
    spec = small_spec(budget={"definition": "zcdp", "rho": "3/10", "delta": 1e-9})
    spec["columns"].update(columns)
    spec["queries"] = [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county", "tract"],
         "by": ["sex"]},
        {"name": "m", "kind": "marginals", "attributes": ATTRIBUTES, "within": "geo.state", "select": "aim"}]
    root = run_release(write_case(tmp_path / "c", spec, rows), key_file=tmp_path / "k.key", ledger=None).release_dir
    record = json.loads((root / "manifest.json").read_text())["selections"][0]
    refits = []
    fit = graphical.fit
    monkeypatch.setattr(graphical, "fit", lambda *args, **kwargs: refits.append(args[4]) or fit(*args, **kwargs))
    synthetic = synthesize_module.synthesize(root)
    state = pq.read_table(root / "tables" / "pop.state.parquet").to_pandas().groupby("state")["count"].sum()
    records = synthetic.records.to_pandas()
    query_totals = pq.read_table(root / "tables" / "m.age.parquet").to_pandas().groupby("state")["count"].sum()
    if query_totals.reindex(state.index).tolist() != state.tolist():  # at this budget, almost always
        # besides post-processing's own fit, recomputed, the fallback's refit ran
        assert synthesize_module.RECORDS_ITERATIONS in refits and len(refits) == 2
    else:
        assert len(refits) == 1 and synthetic.not_reproduced == []
    assert records.groupby("state").size().reindex(state.index, fill_value=0).tolist() == state.tolist()
    for clique in record["chosen"]:
        published = pq.read_table(root / "tables" / f"m.{'-'.join(clique)}.parquet").to_pandas()
        published = published.set_index(["state", *clique])["count"]
        tabulated = records.groupby(["state", *clique]).size().reindex(published.index, fill_value=0)
        assert np.abs(tabulated.to_numpy() - published.to_numpy()).sum() <= 0.05 * published.sum(), clique


def test_a_version_7_aim_release_grows_a_junction_tree_and_still_verifies(tmp_path, monkeypatch):
    """A query past `aim_model.CYCLE_WORK` (here: every query) grows its junction tree
    one attribute a round, as every `select: aim` release of manifest version 7 or earlier did: its tables add up
    and the records reproduce them exactly; relabelled version 7 it verifies with the version-8 rules off (a
    version-8 release with cycles claiming 7 does not)."""
    from dprelease.pipelines import run as run_module
    from dprelease.pipelines.verify import verify_release
    from dprelease.transforms import aim_model

    path = aim_case(tmp_path / "c")
    with monkeypatch.context() as patched:
        patched.setattr(aim_model, "CYCLE_WORK", 0)
        run_module.run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "junction")
    root = tmp_path / "junction" / "test-release"
    manifest = json.loads((root / "manifest.json").read_text())
    [record] = manifest["selections"]
    junction_steps(ATTRIBUTES, [tuple(c) for c in record["chosen"]], 2)
    assert record["rounds"] == 3 and any(len(c) == 3 for c in record["chosen"])  # at rho = 25 a triple beats its noise
    assert verify_release(root).problems  # a version-8 plan of this spec has 6 rounds over a capped model
    manifest["manifest_version"] = 7
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert verify_release(root).problems == []
    manifest["manifest_version"] = 4
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert any("which manifests state from version 5 on" in p for p in verify_release(root).problems)
    manifest["manifest_version"] = 7
    (root / "manifest.json").write_text(json.dumps(manifest))
    names = [f"m.{'-'.join(c)}" for c in record["chosen"]]
    out = tmp_path / "synthetic.parquet"
    assert cli("synthesize", str(root), "--out", str(out)).returncode == 0
    records = pq.read_table(out).to_pandas()
    for clique, name in zip(record["chosen"], names):  # the records reproduce every chosen table
        tabulated = records.groupby(["state", *clique]).size()
        published = pq.read_table(root / "tables" / f"{name}.parquet").to_pandas().set_index(["state", *clique])["count"]
        assert tabulated.reindex(published.index, fill_value=0).tolist() == published.tolist()


def test_a_version_8_aim_release_of_equal_rounds_still_verifies(tmp_path, monkeypatch):
    """Releases of manifest version 8 gave every round one unit and stated the rounds' own losses: one made by
    those rules (a plan without annealing) verifies as version 8, and is refused as version 9 (whose rounds
    anneal: no units recorded)."""
    import functools

    from dprelease.pipelines import run as run_module
    from dprelease.pipelines.verify import verify_release

    with monkeypatch.context() as patched:
        patched.setattr(run_module, "build_plan", functools.partial(build_plan, aim_annealing=False,
                                                                    aim_converged_fit=False))
        run_module.run_release(aim_case(tmp_path / "c"), key_file=tmp_path / "k.key", ledger=None,
                               out_dir=tmp_path / "equal")
    root = tmp_path / "equal" / "test-release"
    manifest = json.loads((root / "manifest.json").read_text())
    [record] = manifest["selections"]
    assert "units" not in record and len(record["chosen"]) == 6
    assert any("one positive integer per chosen table" in p for p in verify_release(root).problems)
    manifest["manifest_version"] = 8
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert verify_release(root).problems == []
    assert verify_release(root, recompute=True).problems == []


def test_a_version_9_aim_release_of_a_fixed_fit_still_verifies(tmp_path, monkeypatch):
    """Releases of manifest version 9 published the margins of a model fitted for a fixed 1000 iterations: one
    made by those rules verifies (recomputing its tables) as version 9 and is refused as version 10, whose
    tables come from a fit run until it settles; a version-10 release is refused relabelled as 9."""
    import functools

    from dprelease.pipelines import run as run_module
    from dprelease.pipelines.verify import verify_release

    with monkeypatch.context() as patched:
        patched.setattr(run_module, "build_plan", functools.partial(build_plan, aim_converged_fit=False))
        run_module.run_release(aim_case(tmp_path / "c"), key_file=tmp_path / "k.key", ledger=None,
                               out_dir=tmp_path / "fixed")
    run_module.run_release(aim_case(tmp_path / "c"), key_file=tmp_path / "k.key", ledger=None,
                           out_dir=tmp_path / "settled")
    fixed, settled = (tmp_path / name / "test-release" for name in ("fixed", "settled"))
    steps = {name: json.loads((root / "manifest.json").read_text())["post_processing"][1]["step"]
             for name, root in (("fixed", fixed), ("settled", settled))}
    assert "1000 iterations" in steps["fixed"] and "until it settles" in steps["settled"]
    for root, wrong, right in ((fixed, 10, 9), (settled, 9, 10)):
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["manifest_version"] = wrong
        (root / "manifest.json").write_text(json.dumps(manifest))
        assert any("post_processing" in p for p in verify_release(root).problems), root
        manifest["manifest_version"] = right
        (root / "manifest.json").write_text(json.dumps(manifest))
        assert verify_release(root, recompute=True).problems == [], root


def test_an_annealed_aim_release_verifies_recomputes_and_synthesizes(tmp_path, monkeypatch):
    """A release whose rounds anneal (forced: every decision anneals, so 6 units run as 1 and 5): the 5-unit table
    gets 5 units' share, the totals state the selection at its allocation (the filter's bound, what the ledger
    charged) and verify (with --recompute, deciding the units again, and --ledger) accepts it; synthesize draws
    from it."""
    from dprelease.pipelines import run as run_module
    from dprelease.pipelines.verify import verify_release
    from dprelease.transforms import aim_model

    path = aim_case(tmp_path / "c", budget={"definition": "zcdp", "rho": "1/2", "delta": 1e-9})
    ledger = tmp_path / "ledger.db"
    assert cli("ledger", "set-budget", "test-data", "--rho", "1", "--ledger", str(ledger)).returncode == 0
    with monkeypatch.context() as patched:
        patched.setattr(aim_model, "anneals", lambda before, after, sigma: True)
        done = run_module.run_release(path, key_file=tmp_path / "k.key", ledger=ledger)
        root = done.release_dir
        manifest = json.loads((root / "manifest.json").read_text())
        [record] = manifest["selections"]
        assert record["units"] == [1, 5] and record["unused_units"] == 0
        tables = {t["name"]: t for t in manifest["tables"]}
        first, last = (tables[f"m.{'-'.join(c)}"] for c in record["chosen"])
        assert Fraction(last["allocated"]["fraction"]) == 5 * Fraction(first["allocated"]["fraction"])
        assert Fraction(manifest["ledger"]["charged"]) == Fraction(manifest["totals"]["rho"]["fraction"])
        assert Fraction(manifest["totals"]["rho"]["fraction"]) <= Fraction(1, 2)
        for options in ({}, {"recompute": True}, {"ledger": str(ledger)}):
            assert verify_release(root, **options).problems == [], options
        again = run_module.run_release(path, key_file=tmp_path / "k.key", ledger=ledger, out_dir=tmp_path / "2")
        rerun = json.loads((again.release_dir / "manifest.json").read_text())
        assert rerun["selections"] == manifest["selections"] and rerun["ledger"]["charged_by_this_run"] == "0"
        assert rerun["tables"] == manifest["tables"] and rerun["totals"] == manifest["totals"]
    out = tmp_path / "synthetic.parquet"
    assert cli("synthesize", str(root), "--out", str(out)).returncode == 0
    state = pq.read_table(root / "tables" / "pop.state.parquet").to_pandas()
    assert pq.read_metadata(out).num_rows == int(state["count"].sum())


def test_verify_refuses_an_edited_aim_selection(tmp_path):
    path = aim_case(tmp_path / "c")
    assert cli("run", str(path), "--key-file", str(tmp_path / "k.key"), "--no-ledger").returncode == 0
    root = path.parent / "out" / "test-release"
    original = (root / "manifest.json").read_text()
    edits = (
        (lambda r: r.update(chosen=[["edu", "inc"], ["age", "sex"], ["edu", "inc"]], units=[1, 1, 1]),
         "is chosen twice"),
        (lambda r: r.update(chosen=[["edu", "inc"], ["inc", "sex"]], units=[1, 1]), "is not a candidate"),
        (lambda r: r.update(chosen=[list(c) for c in itertools.combinations(ATTRIBUTES, 2)] + [["age", "sex", "edu"]],
                            units=[1] * 7), "7 tables chosen; the selection has 6 rounds"),
        (lambda r: r.update(units=[2] + r["units"][1:]), "round 1 has 2 budget units"),
        (lambda r: r.update(units=None), "one positive integer per chosen table"),
        (lambda r: r.update(units=r["units"][:-1]), "one positive integer per chosen table"),
        (lambda r: r.update(unused_units=(r["unused_units"] or 0) + 1), "selections"),
        (lambda r: r.update(chosen=[["edu", "inc"], ["age", "sex", "edu", "inc"], ["age", "sex"]]),
         "not a list of attribute tables"),
        (lambda r: r.update(degree=1), "selections"),
        (lambda r: r["sensitivity"].update(l1=2), "selections"),
    )
    for edit, expected in edits:
        manifest = json.loads(original)
        edit(manifest["selections"][0])
        (root / "manifest.json").write_text(json.dumps(manifest))
        checked = cli("verify", str(root))
        assert checked.returncode == 1 and expected in " ".join((checked.stdout + checked.stderr).split()), \
            checked.stdout + checked.stderr
    manifest = json.loads(original)
    manifest["manifest_version"] = 8  # re-planned with equal rounds: the recorded units are refused, or, where the
    (root / "manifest.json").write_text(json.dumps(manifest))  # key's draws annealed the rounds into fewer tables
    checked = cli("verify", str(root))  # than rounds, the tables first (equal rounds would have chosen more)
    said = " ".join(checked.stderr.split())
    assert checked.returncode == 1 and ("rounds are not annealed" in said or "rounds' budget (6) not spent" in said), said
    manifest = json.loads(original)
    manifest["manifest_version"] = 4
    (root / "manifest.json").write_text(json.dumps(manifest))
    checked = cli("verify", str(root))
    # re-planned by version 4's rules (no cycles): its 6 tables are no junction tree, and aim came with version 5
    assert checked.returncode == 1 and "a junction tree of 4 attributes" in " ".join(checked.stderr.split())
    manifest["manifest_version"] = 5.0  # equal to 5 in Python, but not the integer dprelease writes
    (root / "manifest.json").write_text(json.dumps(manifest))
    checked = cli("verify", str(root))
    assert checked.returncode == 1 and "manifest_version: 5.0 is not an integer" in checked.stderr


@pytest.mark.parametrize("query, expected", [
    ({"degree": 1, "select": "mst"}, "degree = 1: only a `select: aim` query takes a degree"),
    ({"degree": 3}, "queries[1].degree = 3: Input should be less than or equal to 2"),
    ({"degree": "2"}, "queries[1].degree = '2': Input should be a valid integer"),
    ({"way": 3}, "select = 'aim': needs way = 2"),
    ({"workload": [{"attributes": ["age", "job"]}]}, "workload[0].attributes[1] = 'job'"),
    ({"attributes": ["age", "geo.county", "edu", "inc"], "within": None},
     "attributes[1] = 'geo.county': a `select: aim` query's attributes cannot be a geography"),
])
def test_a_bad_aim_query_is_refused_naming_the_field(tmp_path, query, expected):
    done = cli("plan", str(aim_case(tmp_path / "c", **query)))
    assert done.returncode == 2 and expected in " ".join(done.stderr.split()), done.stderr


def test_selections_that_could_read_the_input_too_often_are_refused_before_any_data(tmp_path):
    """20 attributes of 100 values: up to 1.1 billion candidate cells a round, hundreds of passes over the input
    each; the plan says so and refuses (exit 2), before any key, budget or data. Degree 1 fits."""
    spec = small_spec()
    wide = {f"x{i}": {"type": "integer", "min": 0, "max": 99} for i in range(20)}
    spec["columns"].update(wide)
    spec["queries"] = [{"name": "m", "kind": "marginals", "attributes": list(wide), "select": "aim"}]
    done = cli("plan", str(write_case(tmp_path / "c", spec)))
    assert done.returncode == 2 and "passes over the input" in done.stderr and "degree: 1" in done.stderr
    spec["queries"][0]["degree"] = 1
    done = cli("plan", str(write_case(tmp_path / "d", spec)))
    assert done.returncode == 0 and "passes over the input" in " ".join(done.stdout.split()), done.stderr


def test_a_workload_scales_the_aim_sensitivity_by_the_largest_candidate_weight(tmp_path):
    path = aim_case(tmp_path / "c", workload=[{"attributes": ["edu", "inc"], "weight": 3}, {"attributes": ["age"]}])
    [selection] = build_plan(*load_spec(path)).selections
    assert dict(selection.attribute_weights) == {"age": 1, "sex": 0, "edu": 3, "inc": 3}
    assert selection.event.sensitivity.l1 == 7  # the triple (age, edu, inc): 1 + 3 + 3
    done = cli("run", str(path), "--key-file", str(tmp_path / "k.key"), "--no-ledger")
    assert done.returncode == 0, done.stderr
    root = path.parent / "out" / "test-release"
    record = json.loads((root / "manifest.json").read_text())["selections"][0]
    assert {w["attribute"]: w["weight"] for w in record["attribute_weights"]} == {"age": 1, "sex": 0, "edu": 3,
                                                                                  "inc": 3}
    assert cli("verify", str(root)).returncode == 0
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["selections"][0]["attribute_weights"][0]["weight"] = 2
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert cli("verify", str(root)).returncode == 1


def test_a_round_scores_against_the_model_of_the_tables_released_before_it():
    """After (a, b) is measured, the estimate of a candidate (a, b, c) is the fitted (a, b) table times c's
    distribution; of (b, c), that table's b margin times c's distribution: adaptivity, not independence."""
    attributes, sizes, units = ["a", "b", "c"], {"a": 2, "b": 3, "c": 4}, 2
    ab = np.array([[[90, 5, 5], [5, 5, 90]], [[40, 40, 20], [10, 10, 80]]], dtype=np.float64)
    c = np.array([[50, 70, 30, 50], [20, 40, 60, 80]], dtype=np.float64)  # the same unit totals, 200
    one_way = {"a": ab.sum(axis=2), "b": ab.sum(axis=1), "c": c}
    candidates = round_candidates(attributes, [("a", "b")], 2)
    estimates = model_estimates(attributes, one_way, [("a", "b")], [ab], 1e-6, candidates, sizes)
    share_c = one_way["c"] / one_way["c"].sum(axis=1, keepdims=True)
    found = dict(zip(candidates, estimates))
    triple = found[(("a", "b"), "c")]
    assert np.allclose(triple.separator, ab.reshape(units, -1), atol=1) and np.allclose(triple.share, share_c)
    expected = np.rint(triple.separator[:, :, None] * share_c[:, None, :]).astype(np.int64).ravel()
    assert np.array_equal(triple.cells(0, expected.size), expected)
    pair = found[(("b",), "c")]
    assert np.allclose(pair.separator, ab.sum(axis=1), atol=1) and pair.sizes == (3, 4) and pair.child_axis == 1


def test_junction_tables_add_up_and_a_unit_gets_the_same_tables_alone_or_in_a_batch():
    from dprelease.transforms.aim import oriented
    from dprelease.transforms.units.tree_model import junction_tables, sample_junction

    rng = np.random.default_rng(5)
    sizes = {"a": 3, "b": 7, "c": 2, "d": 40}
    cliques = [("b", "c"), ("a", "b", "c"), ("a", "d")]
    units = 9
    totals = rng.integers(0, 300, units)
    margins = {x: rng.normal(totals[:, None] / n, 20, (units, n)) for x, n in sizes.items()}
    raw = [rng.normal(totals.reshape(-1, *[1] * len(c)) / np.prod([sizes[x] for x in c]), 20,
                      (units, *[sizes[x] for x in c])) for c in cliques]
    steps = [(s, n, oriented(t, c, s, n)) for (s, n), c, t in zip(clique_steps(cliques), cliques, raw)]
    one_way, out = junction_tables(totals, "b", margins["b"], steps, margins, [400.0] * 3)
    for (separator, new, _), table in zip(steps, out):
        assert table.dtype == np.int64 and (table >= 0).all()
        assert np.array_equal(table.sum(axis=tuple(range(1, table.ndim - 1))), one_way[new])
        for i, attribute in enumerate(separator):
            others = tuple(1 + j for j in range(table.ndim - 1) if j != i)
            assert np.array_equal(table.sum(axis=others), one_way[attribute])
    assert np.array_equal(out[1].sum(axis=3), out[0])  # (a, b, c) joins a to its separator (b, c): that pair's table
    assert all(np.array_equal(one_way[x].sum(axis=1), totals) for x in sizes)
    alone = junction_tables(totals[4:5], "b", margins["b"][4:5], [(s, n, t[4:5]) for s, n, t in steps],
                            {x: m[4:5] for x, m in margins.items()}, [400.0] * 3)
    assert all(np.array_equal(alone[1][i][0], out[i][4]) for i in range(len(steps)))
    unit, codes = sample_junction(totals, "b", margins["b"], steps, 1, margins, [400.0] * 3)
    for (separator, new, _), table in zip(steps, out):
        tabulated = np.zeros_like(table)
        np.add.at(tabulated, (unit, *[codes[x] for x in separator], codes[new]), 1)
        assert np.array_equal(tabulated, table)


@pytest.mark.parametrize("engine", ["spark", "beam"])
def test_spark_and_beam_grow_the_same_tables_and_publish_the_same_release(tmp_path, engine, monkeypatch):
    """Every round's candidates scored in Spark executors and Beam workers from the driver's model of the tables
    released so far (only integer scores reach the driver): the same cliques and, file for file, the release the
    embedded engine publishes; with annealed rounds (forced here: units 1, 2, 3 under pure DP), a table of 2 units
    released by the engine during the rounds."""
    from dprelease.transforms import aim_model

    monkeypatch.setattr(aim_model, "anneals", lambda before, after, sigma: True)
    path = aim_case(tmp_path / "c", budget={"definition": "pure", "epsilon": 8})
    assert_same_selection_and_release(tmp_path, path, engine)
    units = [json.loads((tmp_path / where / "test-release" / "manifest.json").read_text())["selections"][0]["units"]
             for where in ("embedded", engine)]
    assert units == [[1, 2, 3]] * 2


def test_the_largest_aim_workload_a_spec_allows_fits_the_selection_kernel():
    """A triple of attributes each in every one of 10,000 workload marginals of weight 1000, at k = 10,000 under
    replace: 2 * sensitivity * the selection epsilon's denominator stays within the kernel's 62 bits, so no run
    can fail there after its budget is charged."""
    from dprelease.accounting.mechanisms import _MAX_DENOMINATOR
    from dprelease.accounting.sensitivity import ContributionBounds, mst_score_sensitivity
    from dprelease.pipelines.spec import (MAX_AIM_DEGREE, MAX_RECORDS_PER_UNIT, MAX_WORKLOAD_MARGINALS,
                                          MAX_WORKLOAD_WEIGHT)

    per_attribute = {a: MAX_WORKLOAD_WEIGHT * MAX_WORKLOAD_MARGINALS for a in "abcd"}
    heaviest = largest_weight(per_attribute, MAX_AIM_DEGREE)
    assert heaviest == (MAX_AIM_DEGREE + 1) * MAX_WORKLOAD_WEIGHT * MAX_WORKLOAD_MARGINALS
    sensitivity = mst_score_sensitivity(ContributionBounds(MAX_RECORDS_PER_UNIT, "replace"), heaviest, "aim").l1
    assert 2 * sensitivity * _MAX_DENOMINATOR <= 2 ** 62


@pytest.mark.parametrize("spilled", [False, True])
def test_passes_over_kept_bounded_records_count_what_reading_the_input_counts(tmp_path, monkeypatch, spilled):
    """Units of 3 records bounded to 2, every round split into many passes: the embedded engine's later passes
    count from the bounded records its second pass kept (`spilled`: by two workers, one file per spill
    partition); the release (tables chosen, every file) is the one that reading and bounding the input on every
    pass publishes."""
    import dprelease.pipelines.engines.embedded as embedded
    import dprelease.pipelines.selection as selection
    from dprelease.pipelines.run import run_release

    rows, columns = dependent_people(np.random.default_rng(8), 900)
    rows["pid"] = [i // 3 for i in range(900)]
    spec = small_spec(budget={"definition": "zcdp", "rho": 20, "delta": 1e-9}, contribution={"max_records_per_unit": 2})
    spec["columns"].update(columns)
    spec["queries"] = [{"name": "m", "kind": "marginals", "attributes": ATTRIBUTES, "within": "geo.state",
                        "select": "aim"}]
    path = write_case(tmp_path / "c", spec, rows)
    monkeypatch.setattr(selection, "AIM_ROUND_CELLS", 10)  # one candidate a pass
    counted = []
    if spilled:
        monkeypatch.setattr(embedded, "PARTITION_BYTES", 2000)
        in_workers = embedded.EmbeddedEngine._counts_in_workers
        monkeypatch.setattr(embedded.EmbeddedEngine, "_counts_in_workers",
                            lambda *args, **kwargs: counted.append(1) or in_workers(*args, **kwargs))
    kept = run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "kept", workers=2)
    assert bool(counted) == spilled
    score = embedded.EmbeddedEngine.score_candidates

    def reading_every_pass(self, *args, **kwargs):
        self.close()
        self._bounded = None
        return score(self, *args, **kwargs)

    monkeypatch.setattr(embedded.EmbeddedEngine, "score_candidates", reading_every_pass)
    read = run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "read")
    manifests = [json.loads((r.release_dir / "manifest.json").read_text()) for r in (kept, read)]
    assert manifests[0]["selections"] == manifests[1]["selections"]
    assert [f["sha256"] for f in manifests[0]["files"]] == [f["sha256"] for f in manifests[1]["files"]]


@pytest.mark.parametrize("engine", ["spark", "beam", "beam-no-unit"])
def test_selection_reads_the_input_once_and_counts_every_pass_from_the_kept_records(tmp_path, monkeypatch, engine):
    """Units of 3 records bounded to 2, every round split into many passes, on Spark local[2] and Beam's
    DirectRunner (also records as units): the input is read (encoded, bounded) once for the
    whole selection, the records kept (on the executors' disks; in private files of Beam's result storage, removed
    at the end), and every pass counts from them; the release (tables chosen, every file) is the embedded
    engine's, which reads the input on every pass when its kept records are dropped."""
    import dprelease.pipelines.selection as selection
    from dprelease.pipelines.run import run_release

    from .test_spark import assert_same_release

    pytest.importorskip("pyspark" if engine == "spark" else "apache_beam")
    if engine == "spark":
        import dprelease.pipelines.engines.spark as module
        engine_class, reader, options = module.SparkEngine, "_by_unit", {"master": "local[2]"}
    else:
        import dprelease.pipelines.engines.beam as module
        engine_class, reader = module.BeamEngine, "_encoded"
        options = {"beam_options": ["--direct_running_mode=in_memory"]}  # a pipeline a pass: no process start-up
    rows, columns = dependent_people(np.random.default_rng(8), 900)
    rows["pid"] = [i // 3 for i in range(900)]
    spec = small_spec(budget={"definition": "zcdp", "rho": 20, "delta": 1e-9}, contribution={"max_records_per_unit": 2})
    if engine == "beam-no-unit":
        spec["privacy_unit"], spec["contribution"] = None, {"max_records_per_unit": 1}
        monkeypatch.setattr(module, "_named_task_batches", module.public_failures("count reads", _counted_reads(
            module._named_task_batches, tmp_path / "reads")))
    spec["columns"].update(columns)
    spec["queries"] = [{"name": "m", "kind": "marginals", "attributes": ATTRIBUTES[:3], "within": "geo.state",
                        "select": "aim"}]
    path = write_case(tmp_path / "c", spec, rows)
    monkeypatch.setattr(selection, "AIM_ROUND_CELLS", 10)  # one candidate a pass
    embedded = run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / "embedded")
    reads, passes, kept = [], [], []
    read, score, keep = getattr(engine_class, reader), engine_class.score_candidates, getattr(engine_class, "_keep", None)
    monkeypatch.setattr(engine_class, reader, lambda self, *a: reads.append(1) or read(self, *a))
    monkeypatch.setattr(engine_class, "score_candidates", lambda self, *a, **k: passes.append(1) or score(self, *a, **k))
    if keep:
        monkeypatch.setattr(engine_class, "_keep", lambda self, *a: keep(self, *a) or kept.append(self._kept[1]))
    other = run_release(path, key_file=tmp_path / "k.key", ledger=None, out_dir=tmp_path / engine,
                        engine=engine.split("-")[0], **options)
    if engine == "beam-no-unit":  # read in the workers: each read task marks a file
        tasks = [p.name.split("-")[1] for p in (tmp_path / "reads").iterdir()]
        assert len(passes) > 3 and len(tasks) == len(set(tasks)) > 0  # each read task read once by the selection
    else:
        assert len(passes) > 3 and len(reads) == 2  # the selection's one read, then the release's
    assert kept == [] if engine == "spark" else (len(set(kept)) == 1 and not Path(kept[0]).exists())
    chosen = [json.loads((r.release_dir / "manifest.json").read_text())["selections"][0]["chosen"]
              for r in (embedded, other)]
    assert chosen[0] == chosen[1]
    assert_same_release(embedded.release_dir, other.release_dir, engine.split("-")[0])


def _counted_reads(function, directory: Path):
    """`function` of a (read task number, task) element, marking each call in `directory` (workers are processes
    of their own)."""
    def counted(element, *args):
        directory.mkdir(exist_ok=True)
        (directory / f"task-{element[0]}-{os.getpid()}-{time.monotonic_ns()}").touch()
        yield from function(element, *args)
    return counted


def test_the_spark_count_of_kept_records_counts_a_table_once_however_often_it_is_named(tmp_path):
    """A selection pass names the table the round before chose both as released and as counted: counted twice it
    would be released with twice its sensitivity (found by the test above, which then chose other tables)."""
    import pyarrow as pa

    from dprelease.pipelines.engines.spark import _count_kept_function, _range_steps

    spec = write_case(tmp_path / "c", small_spec())
    plan = build_plan(*load_spec(spec))
    columns = plan.encoded_columns()
    rng = np.random.default_rng(5)
    codes = {c: rng.integers(0, plan.domains[c].size, 500).astype(np.int32) for c in columns}
    batch = pa.RecordBatch.from_pydict({f"c{i}": pa.array(codes[c]) for i, c in enumerate(columns)})
    counts = [b for b in _count_kept_function(plan, [0, 1, 0, 1], _range_steps(plan))([batch])]
    found = pa.Table.from_batches(counts)
    for table_id in (0, 1):
        mine = found.filter(pa.compute.equal(found["table_id"], table_id))
        vector = np.zeros(plan.tables[table_id].layout.n_measured, dtype=np.int64)
        for cells, counts in zip(mine["cells"].to_pylist(), mine["counts"].to_pylist()):
            np.add.at(vector, np.frombuffer(cells, np.int64), np.frombuffer(counts, np.int64))
        assert np.array_equal(vector, plan.tables[table_id].layout.measure_vector(codes, 500))

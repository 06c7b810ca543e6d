"""`dprelease report`: a self-contained HTML page, rendered in headless Chromium without errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from dprelease.pipelines.commands import write_report
from dprelease.pipelines.run import run_release

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def released(case, tmp_path):
    return run_release(case(invariants=["pop.state"], neighbouring="replace"), key_file=tmp_path / "k.key").release_dir


def test_report_holds_what_an_auditor_needs(released):
    path, report = write_report(released)
    assert report.ok and path.parent == released.parent and path.name == "test-release.report.html"
    html = path.read_text()
    manifest = json.loads((released / "manifest.json").read_text())
    for table in manifest["tables"]:
        assert table["name"] in html
    for entry in manifest["files"]:
        assert entry["sha256"] in html
    for heading in ("In brief", "Budget", "Noise and expected error per cell", "Privacy loss per attribute",
                    "Post-processing", "Invariants", "Ledger", "Files"):
        assert f"<h2>{heading}" in html, heading
    outside = html.replace("http://www.w3.org/2000/svg", "").replace("http://www.w3.org/1999/xlink", "")
    assert "<script" not in html and "http" not in outside  # self-contained: nothing fetched
    assert "verify: passed" in html and "--recompute: not run" in html and "--ledger: not run" in html


def test_a_director_reads_the_release_on_its_first_screen(tmp_path):
    """Issue 30: what was published, the guarantee in one sentence (ε to three significant figures, the exact
    terms on hover), each query's typical error as a share of its typical value and its share of cells within
    ±10%, which tables are too noisy; identical rows grouped; figures as inline SVG; the ledger block in words."""
    import re

    from .conftest import write_case
    from .test_api import persons, spec_with_means

    frame = persons(300)
    spec = write_case(tmp_path / "case", spec_with_means(), rows={c: frame[c].tolist() for c in frame.columns})
    ledger = tmp_path / "ledger.sqlite"
    subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "ledger", "set-budget", "test-data",
                    "--epsilon", "5", "--ledger", str(ledger)], check=True, capture_output=True)
    released = run_release(spec, key_file=tmp_path / "k.key", ledger=str(ledger)).release_dir
    html = write_report(released)[0].read_text()
    brief = html.split("<h2>In brief</h2>")[1].split("<h2>")[0]
    manifest = json.loads((released / "manifest.json").read_text())
    assert f"{len(manifest['tables'])} tables" in brief and "too noisy" in brief
    assert re.search(r'<abbr title="epsilon = [0-9/]+ \(pure DP\)">ε = [0-9.]+</abbr>', brief)
    assert "cells within ±10%" in brief and re.search(r"<td>pop</td><td>hierarchy</td>", brief)
    assert brief.count("<svg") >= 2  # error against size, small tables' values with their intervals
    budget = html.split("<h2>Budget</h2>")[1].split("<h2>")[0]
    assert re.search(r"<td>pop</td><td class=\"num\">4</td>", budget)  # the hierarchy's 4 tables: one row
    ledger_block = html.split("<h2>Ledger</h2>")[1].split("<h2>")[0]
    text = re.sub(r"<[^>]+>", " ", ledger_block)
    assert "Lifetime budget" in text and "Rerun of committed release" in text and " no " in text
    assert "None" not in text and "False" not in text and "lifetime_budget" not in text
    mean_row = next(r for r in re.findall(r"<tr>(.*?)</tr>", html, flags=re.S) if "income_mean (mean" in r)
    numerator = float(re.search(r"≤ ([0-9,.]+) / n", mean_row).group(1).replace(",", ""))
    plan = {r["table"]: r for r in dprelease_plan(spec)}
    assert numerator == pytest.approx(plan["income_mean"]["mean_std_at_n"], rel=1e-2)


def test_the_banner_says_which_checks_ran(tmp_path):
    """A release whose tract counts were shifted and rehashed still agrees with itself (plain verify passes), so
    the page must not read as fully verified: it says --recompute did not run; with --recompute the edit is a
    mismatch."""
    import pyarrow.parquet as pq

    from .conftest import small_spec, write_case
    from .test_api import persons
    from .test_hostile_releases import edit_table, set_column

    frame = persons(600)[["pid", "geo", "age", "sex"]]
    spec = write_case(tmp_path / "c", small_spec(), rows={c: frame[c].tolist() for c in frame.columns})
    released = run_release(spec, key_file=tmp_path / "k.key", ledger=None).release_dir

    def bump(table):
        counts = table.column("count").to_numpy().copy()
        counts[0] += 1
        counts[1] -= 1
        return set_column(table, "count", counts)

    if pq.read_table(released / "tables" / "pop.tract.parquet").column("count").to_numpy()[1] == 0:
        pytest.skip("the first tract pair cannot be shifted by one")
    edit_table(released, "tables/pop.tract", bump)
    path, report = write_report(released, tmp_path / "plain.html")
    assert report.ok and "verify: passed" in path.read_text() and "--recompute: not run" in path.read_text()
    path, report = write_report(released, tmp_path / "recomputed.html", recompute=True)
    assert not report.ok and "--recompute: failed" in path.read_text() and "MISMATCH" in path.read_text()


def dprelease_plan(spec) -> list[dict]:
    import dprelease

    return dprelease.Release.from_yaml(spec).plan().to_dict("records")


def test_report_shows_mismatches_and_exits_1(released):
    (released / "tables" / "pop.state.csv").write_text("tampered\n")
    result = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "report", str(released)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "MISMATCH" in (released.parent / "test-release.report.html").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(released, tmp_path):
    path, _ = write_report(released)
    screenshot = tmp_path / "report.png"
    shot = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2000",
                           "--enable-logging=stderr", "--v=0", f"--screenshot={screenshot}", path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert screenshot.is_file() and screenshot.stat().st_size > 20_000, shot.stderr[-2000:]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page_errors = [line for line in shot.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert page_errors == []
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert "Release test-release" in dom and "pop.tract" in dom and "<svg" in dom and "In brief" in dom


@pytest.mark.parametrize("text", ["{}", "[]", "null", '{"ledger": 5, "files": [1], "tables": "x"}'])
def test_a_malformed_manifest_gives_a_page_of_mismatches_not_a_traceback(released, tmp_path, text):
    (released / "manifest.json").write_text(text)
    ran = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "report", str(released),
                          "--out", str(tmp_path / "r.html")], capture_output=True, text=True)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr + ran.stdout
    page = (tmp_path / "r.html").read_text()
    assert "MISMATCH" in page and "manifest" in page and "<h2>Ledger</h2>" not in page

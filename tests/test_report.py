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
    for heading in ("Budget split", "Expected error per cell", "Post-processing", "Invariants", "Ledger", "Files"):
        assert heading in html
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "Verified" in html


def test_error_bars_compare_within_a_kind_and_losses_per_attribute_are_shown(tmp_path):
    """A sum's huge margin no longer flattens the count tables' bars (one scale per kind of value); the loss per
    attribute and geography level is on the page; the ledger block reads as words, not Python reprs."""
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
    widths = {}
    for row in re.findall(r"<tr>(.*?)</tr>", html):
        name = re.search(r"<td[^>]*>([^<]+)</td>", row)
        line = re.search(r'<line x1="([0-9.]+)" y1="8" x2="([0-9.]+)"', row)
        if name and line:
            widths[name.group(1)] = float(line.group(2)) - float(line.group(1))
    assert widths["pop.tract"] > 100 and widths["income_total"] > 100  # each kind's largest fills its bar
    assert "Privacy loss per attribute and geography level" in html
    plots = html.split("Published values with 95% intervals")[1].split("<h2>")[0]
    assert "<h3>pop.state</h3>" in plots and "<h3>income_total</h3>" in plots and "<circle" in plots
    assert "<h3>pop.tract</h3>" not in plots or len(re.findall("<circle", plots)) <= 60 * 10
    assert re.search(r"geography level</td><td[^>]*>geo.county</td>", html)
    ledger_block = html.split("<h2>Ledger</h2>")[1].split("<h2>")[0]
    text = re.sub(r"<[^>]+>", " ", ledger_block)
    assert "Lifetime budget" in text and "Rerun of committed release" in text and " no " in text
    assert "None" not in text and "False" not in text and "lifetime_budget" not in text
    mean_row = next(r for r in re.findall(r"<tr>(.*?)</tr>", html) if ">income_mean<" in r)
    numerator = float(re.search(r"≤ ([0-9,.]+) / n", mean_row).group(1).replace(",", ""))
    plan = {r["table"]: r for r in dprelease_plan(spec)}
    assert numerator == pytest.approx(plan["income_mean"]["mean_std_at_n"], rel=1e-3)


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
    assert "Release test-release" in dom and "pop.tract" in dom and "<svg" in dom


@pytest.mark.parametrize("text", ["{}", "[]", "null", '{"ledger": 5, "files": [1], "tables": "x"}'])
def test_a_malformed_manifest_gives_a_page_of_mismatches_not_a_traceback(released, tmp_path, text):
    (released / "manifest.json").write_text(text)
    ran = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "report", str(released),
                          "--out", str(tmp_path / "r.html")], capture_output=True, text=True)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr + ran.stdout
    page = (tmp_path / "r.html").read_text()
    assert "MISMATCH" in page and "manifest" in page and "<h2>Ledger</h2>" not in page

"""A scheduled monthly series (deploy/schedule) against one ledger: a second release in one month is
refused by the per-period budget, the third month by the lifetime budget, and a re-run of a published month
is a no-op."""
from __future__ import annotations

import shutil
import subprocess

from dprelease.pipelines.commands import demo_data

from .conftest import REPO


def test_three_monthly_releases_with_budget_for_two(tmp_path):
    series = tmp_path / "series"
    series.mkdir()
    shutil.copy(REPO / "examples" / "demo" / "monthly.yaml", series / "monthly.yaml")
    shutil.copy(REPO / "examples" / "demo" / "geography.txt", series / "geography.txt")
    demo_data(20_000, series / "data")
    ledger = tmp_path / "ledger.sqlite"
    budget = subprocess.run(["dprelease", "ledger", "set-budget", "demo-census", "--rho", "2", "--per-period", "1",
                             "--ledger", str(ledger)],
                            capture_output=True, text=True)
    assert budget.returncode == 0, budget.stderr
    script = REPO / "deploy" / "schedule" / "monthly-release.sh"
    statuses = []
    for month in ("2026-01", "2026-02", "2026-03"):
        run = subprocess.run(["bash", str(script), str(series / "monthly.yaml"), month, str(ledger), str(tmp_path / "keys")],
                             capture_output=True, text=True)
        statuses.append(run.returncode)
        if run.returncode == 0:
            assert "OK" in run.stdout
        else:
            assert "budget refused" in run.stderr and "only 0" in run.stderr
        if month == "2026-01":
            # the same release id with a new key is refused outright (a release id names one release) ...
            extra = subprocess.run(["bash", str(script), str(series / "monthly.yaml"), month, str(ledger),
                                    str(tmp_path / "other-keys"), "--overwrite"], capture_output=True, text=True)
            assert extra.returncode == 2 and "already committed" in extra.stderr, extra.stderr
            # ... and a corrected January under a new id exceeds January's budget
            corrected = series / "corrected.yaml"
            corrected.write_text((series / "monthly.yaml").read_text().replace("demo-{{MONTH}}", "demo-{{MONTH}}-r2"))
            extra = subprocess.run(["bash", str(script), str(corrected), month, str(ledger),
                                    str(tmp_path / "other-keys")], capture_output=True, text=True)
            assert extra.returncode == 3 and "month 2026-01" in extra.stderr, extra.stderr
            assert not (tmp_path / "other-keys" / "2026-01.key").exists()
    assert statuses == [0, 0, 3]
    # a catch-up (or repeated) run of a published month is a no-op: verified against the ledger, exit 0
    january = series / "releases" / "demo-2026-01" / "manifest.json"
    before = january.read_bytes()
    again = subprocess.run(["bash", str(script), str(series / "monthly.yaml"), "2026-01", str(ledger),
                            str(tmp_path / "keys")], capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr
    assert january.read_bytes() == before
    # the filled-in specs went to a private work directory, never beside the template
    assert sorted(p.name for p in series.iterdir()) == ["corrected.yaml", "data", "geography.txt", "monthly.yaml",
                                                         "releases"]
    published = sorted(p.name for p in (series / "releases").iterdir() if not p.name.startswith("."))
    assert published == ["demo-2026-01", "demo-2026-02"]
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["2026-01.key", "2026-02.key"]
    shown = subprocess.run(["dprelease", "ledger", "show", "demo-census", "--ledger", str(ledger)],
                           capture_output=True, text=True)
    assert shown.stdout.count("committed") == 2

"""The documentation runs: every Python block of docs/quickstart.md, in order, in one namespace."""
from __future__ import annotations

import json
import re

import numpy as np

from .conftest import REPO


def python_blocks(path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_quickstart_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(REPO / "docs" / "quickstart.md")
    assert len(blocks) == 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/quickstart.md", "exec"), namespace)  # noqa: S102 - our own documentation
    printed = capsys.readouterr().out
    assert "refused:" in printed and "no budget" in printed
    assert namespace["report"].ok
    assert (tmp_path / "releases" / "quickstart-2026" / "manifest.json").exists()


BLOCKER = """
import importlib.abc, sys
BLOCKED = frozenset({blocked!r})
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".", 1)[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (only `pip install .`)", name=name)
        return None
sys.meta_path.insert(0, Blocker())
"""


def _extra_only_modules() -> set[str]:
    """The import names of every package only an extra installs (what `pip install .` alone lacks)."""
    from importlib.metadata import packages_distributions, requires

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")

    base = {name(r) for r in requires("dprelease") if "extra ==" not in r}
    extra = {name(r) for r in requires("dprelease") if "extra ==" in r} - base
    return {module for module, distributions in packages_distributions().items()
            if any(d.lower().replace("_", "-") in extra for d in distributions)
            and not any(d.lower().replace("_", "-") in base for d in distributions)}


def test_quickstart_runs_from_the_base_install_alone(tmp_path):
    """Issue 30: `pip install .` without extras must run the quickstart. Every module only an extra installs
    is made unimportable (in this process's children too, through sitecustomize), then the blocks run."""
    import subprocess
    import sys

    blocked = _extra_only_modules()
    assert {"pyspark", "apache_beam", "great_expectations"} <= blocked and "pandas" not in blocked
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked)))
    script = tmp_path / "quickstart.py"
    script.write_text("\n".join(python_blocks(REPO / "docs" / "quickstart.md")))
    import os

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "releases" / "quickstart-2026" / "manifest.json").exists()


def test_api_reference_names_what_exists():
    """Every `release.x` / `result.x` member docs/api.md documents exists."""
    import dprelease

    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    for member in set(re.findall(r"`release\.([a-z_]+)", text)):
        assert hasattr(dprelease.Release, member) or member in ("spec",), member
    for member in set(re.findall(r"`(table_names|mean_names|table|tables|verify|directory|manifest)`", text)):
        assert hasattr(dprelease.ReleaseResult, member) or member in dprelease.ReleaseResult.__dataclass_fields__


def _load(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_notebook_is_the_quickstart():
    """examples/quickstart.ipynb holds exactly the quickstart's prose and code (rebuild: python docs/make_notebook.py)."""
    built = _load("make_notebook").render((REPO / "docs" / "quickstart.md").read_text(encoding="utf-8"))
    assert (REPO / "examples" / "quickstart.ipynb").read_text(encoding="utf-8") == built
    code = ["".join(c["source"]) for c in json.loads(built)["cells"] if c["cell_type"] == "code"]
    assert [c.strip() for c in code] == [b.strip() for b in python_blocks(REPO / "docs" / "quickstart.md")]


def test_the_notebook_executes(tmp_path):
    """The notebook runs top to bottom in a real Jupyter kernel (nbclient + ipykernel), as a user runs it."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                   ).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "refused:" in outputs and "no budget" in outputs
    assert (tmp_path / "releases" / "quickstart-2026" / "manifest.json").exists()


def test_the_reference_pages_are_generated_from_the_code():
    """docs/reference/spec.md (from the JSON Schema) and cli.md (from --help) are what the code says now
    (rebuild: python docs/make_reference.py)."""
    module = _load("make_reference")
    for relative, make in module.PAGES.items():
        assert (REPO / "docs" / relative).read_text(encoding="utf-8") == make(), relative


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """mkdocs --strict: every page, link, README/deploy snippet and docstring reference resolves."""
    import subprocess
    import sys

    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    privacy = (tmp_path / "site" / "privacy" / "index.html").read_text(encoding="utf-8")
    assert "L2 = k max(sqrt(2) M, hi - lo)" in privacy  # the sum's derivation, from accounting/sensitivity.py


def bash_blocks(path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_the_statistician_and_auditor_tutorials_run_as_written(tmp_path):
    """Every bash block of the two tutorials, in order, from a copy of the repository's examples with nothing
    beside it (the Adult data ships in examples/adult/data/), with the user's default ledger: the shipped Adult
    release planned, run, reported and verified (also --recompute and --ledger) from the CLI."""
    import shutil
    import subprocess

    root = tmp_path / "repo"
    (root / "examples").mkdir(parents=True)
    shutil.copytree(REPO / "examples" / "adult", root / "examples" / "adult")
    (root / "examples" / "demo").mkdir()
    for name in ("spec.yaml", "geography.txt"):
        shutil.copy(REPO / "examples" / "demo" / name, root / "examples" / "demo" / name)
    blocks = bash_blocks(REPO / "docs" / "tutorials" / "statistician.md") + \
        bash_blocks(REPO / "docs" / "tutorials" / "auditor.md")
    assert len(blocks) == 6
    for block in blocks:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, (block, done.stdout[-2000:], done.stderr[-2000:])
    assert (root / "examples" / "adult" / "releases" / "adult-2way.report.html").exists()
    assert list((root / "private" / "attack").glob("attack-demo-2026.json"))  # the reconstruction check ran
    assert json.loads((root / "plan.json").read_text())["tables"]
    # the shipped Adult example end to end (the blocks ran and verified it): all 91 2-way tables at (1, 1e-9)
    manifest = json.loads((root / "examples" / "adult" / "releases" / "adult-2way" / "manifest.json").read_text())
    assert len(manifest["tables"]) == 91 and manifest["totals"]["epsilon_at_delta"] <= 1.0


def run_adult_howto(tmp_path, page: str, blocks: int):
    """Every bash block of docs/howto/`page`, in order, from a copy of the repository's examples with nothing
    beside it; the repository copy's root and the last block's result."""
    import shutil
    import subprocess

    root = tmp_path / "repo"
    (root / "examples").mkdir(parents=True)
    shutil.copytree(REPO / "examples" / "adult", root / "examples" / "adult")
    found = bash_blocks(REPO / "docs" / "howto" / page)
    assert len(found) == blocks
    for block in found:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, (block, done.stdout[-2000:], done.stderr[-2000:])
    return root, done


def test_the_synthetic_microdata_howto_runs_as_written(tmp_path):
    """Every bash block of the how-to, in order: plan, budget, run, verify and synthesize of an MST release, then
    of one with a workload, then of an AIM-style one."""
    import pyarrow.parquet as pq

    root, done = run_adult_howto(tmp_path, "synthetic.md", 4)
    # the AIM records follow a model of tables that close cycles: close to every published table (0.005 per record
    # on average, at most 0.05 (age-marital-status, 595 cells), where its noisy measurement is 0.41 away)
    [aim] = json.loads((root / "examples" / "adult" / "releases" / "adult-synthetic-aim" / "manifest.json").read_text()
                       )["selections"]
    # 26 budget units; the rounds anneal (a round spends more units once tables teach the model less than their noise)
    assert aim["method"] == "aim" and aim["rounds"] == 26 and sum(aim["units"]) + aim["unused_units"] == 26
    assert len(aim["chosen"]) == len(aim["units"]) >= 13 and max(aim["units"]) > 1
    utility = json.loads((root / "adult-aim.parquet.utility.json").read_text())["tables"]
    assert len(utility) == 14 + len(aim["chosen"]) and max(t["l1_to_published_per_record"] for t in utility) < 0.1
    assert np.mean([t["l1_to_published_per_record"] for t in utility]) < 0.01
    for records in ("adult-synthetic", "adult-income", "adult-aim"):
        assert pq.read_metadata(root / f"{records}.parquet").num_rows > 40_000
    [selection] = json.loads((root / "examples" / "adult" / "releases" / "adult-synthetic-income" /
                              "manifest.json").read_text())["selections"]
    weights = {tuple(w["pair"]): w["weight"] for w in selection["workload_weights"]}
    assert weights[("age", "income>50K")] == 7 and weights[("age", "sex")] == 1 and selection["sensitivity"]["l1"] == 7


def test_the_randomized_response_howto_runs_as_written(tmp_path):
    """Every bash block of the how-to, in order: rehearse a collection of Adult's income, plan, budget, run and
    verify; the debiased count of high incomes lies within 5 of its stated standard deviations of the truth,
    which the reports alone miss by far more."""
    import pandas

    import dprelease

    root, done = run_adult_howto(tmp_path, "randomized_response.md", 2)
    assert "Randomized response: income>50K (k = 2" in " ".join(done.stdout.split())
    truth = int((pandas.read_csv(REPO / "examples" / "adult" / "data" / "adult.csv")["income>50K"] == 1).sum())
    release = dprelease.ReleaseResult.open(root / "examples" / "adult" / "releases" / "adult-randomized")
    debiased = release.debiased("income").set_index("income>50K")
    assert abs(debiased.loc["1", "estimate"] - truth) < 5 * debiased.loc["1", "std"]
    reported = release.table("income").set_index("income>50K").loc["1", "count"]
    assert abs(reported - truth) > 20 * debiased.loc["1", "std"]

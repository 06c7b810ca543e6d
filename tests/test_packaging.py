"""Packaging: one namespace, no generic top-level names, a console command, no float noise."""
from __future__ import annotations

import re
import shutil
import site
from pathlib import Path

from .conftest import REPO


def test_only_the_dprelease_namespace_is_installed():
    """site-packages holds dprelease/ (or an editable finder), never pipelines/, transforms/, ..."""
    generic = {"pipelines", "transforms", "accounting", "examples", "tests", "deploy", "benchmarks"}
    found, ours = [], False
    for directory in map(Path, site.getsitepackages() + [site.getusersitepackages()]):
        if not directory.is_dir():
            continue
        names = {p.name.removesuffix(".py") for p in directory.iterdir()}
        found += sorted(names & generic)
        ours |= "dprelease" in names or any(n.startswith("__editable___dprelease") for n in names)
    assert found == []
    assert ours
    import dprelease.pipelines

    assert dprelease.pipelines.__name__ == "dprelease.pipelines"


def test_console_command_is_installed():
    assert shutil.which("dprelease") is not None


def test_no_floating_point_noise_in_release_code():
    """No numpy/random float Laplace or Gaussian draws anywhere in the shipped packages."""
    pattern = re.compile(r"\b(laplace|normal|gauss|standard_normal|exponential)\s*\(")
    offenders = []
    for folder in ("pipelines", "transforms", "accounting"):
        for path in [*(REPO / folder).rglob("*.py"), *(REPO / folder).rglob("*.c")]:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "def " not in line:
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []
    python = "".join(p.read_text() for p in (REPO / "transforms").rglob("samplers*.py"))
    assert "import random" not in python
    assert not re.search(r"\b(np|numpy|math)\.(exp|log|random)\b", python)
    c_code = re.sub(r"/\*.*?\*/", "", (REPO / "transforms" / "_exact.c").read_text(), flags=re.S)
    assert not re.search(r"\b(exp|log|rand|random|drand48)\s*\(", c_code)

"""Shared fixtures: small specs and inputs written to a temporary directory."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO_SPEC = REPO / "examples" / "demo" / "spec.yaml"
ADULT_SPEC = REPO / "examples" / "adult" / "spec.yaml"


def _private_worker_tmpdir() -> None:
    """Under pytest-xdist (the README's `-n 2`), each worker process gets its own TMPDIR, inherited by every
    subprocess it starts (CLI runs, Spark's JVM, Beam's workers): the tests that check a run leaves nothing in
    TMPDIR, or that the next run removes what a killed one left there, must not see another worker's live runs.
    Its `__main__` gets a file (`tests/xdist_main.py`) so that importing pyspark's connect module does not exit."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or os.environ.get("DPRELEASE_TEST_TMPDIR_OF") == worker:
        return
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None and not hasattr(main, "__file__"):
        main.__file__ = str(Path(__file__).with_name("xdist_main.py"))  # see that file
    system = tempfile.gettempdir()
    private = tempfile.mkdtemp(prefix=f"pytest-worker-{worker}-")
    os.environ.update(TMPDIR=private, DPRELEASE_TEST_TMPDIR_OF=worker, DPRELEASE_TEST_SYSTEM_TMPDIR=system)
    tempfile.tempdir = private
    atexit.register(shutil.rmtree, private, True)


_private_worker_tmpdir()

GEO_LEAVES = ["01001000100", "01001000200", "01003000100", "02005000100", "02005000200", "02005000300"]


def small_spec(**overrides) -> dict:
    """A small valid spec document: geography (2 states, 3 counties, 6 tracts), age, sex."""
    spec = {
        "release_id": "test-release",
        "dataset_id": "test-data",
        "input": {"path": "input.parquet"},
        "privacy_unit": "pid",
        "neighbouring": "add_remove",
        "budget": {"definition": "pure", "epsilon": 1},
        "contribution": {"max_records_per_unit": 1},
        "columns": {
            "geo": {"type": "geography", "domain_file": "geo.txt", "levels": {"state": 2, "county": 5, "tract": 11}},
            "age": {"type": "integer", "min": 0, "max": 99, "bins": [0, 18, 65, 100]},
            "sex": {"type": "categorical", "values": ["F", "M"]},
        },
        "queries": [
            {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county", "tract"]},
            {"name": "agesex", "kind": "marginals", "attributes": ["age", "sex"], "way": 2, "within": "geo.state"},
            {"name": "by_sex", "kind": "histogram", "by": ["sex"]},
        ],
        "output": {"dir": "out"},
    }
    spec.update(overrides)
    return spec


def write_case(directory: Path, spec: dict, rows: dict | None = None, schema: pa.Schema | None = None) -> Path:
    """Write spec.yaml, geo.txt and input.parquet into `directory`; return the spec path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "geo.txt").write_text("\n".join(GEO_LEAVES) + "\n")
    if rows is None:
        rows = {"pid": [1, 2, 3], "geo": [GEO_LEAVES[0], GEO_LEAVES[3], GEO_LEAVES[5]],
                "age": [10, 40, 70], "sex": ["F", "M", "F"]}
    table = pa.table(rows, schema=schema) if schema is not None else pa.table(rows)
    pq.write_table(table, directory / "input.parquet")
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(autouse=True)
def private_user_data(tmp_path_factory, monkeypatch):
    """Every test gets its own user data directory (where the default ledger lives), never the real one."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    monkeypatch.delenv("DPRELEASE_LEDGER", raising=False)


@pytest.fixture
def case(tmp_path):
    """Factory: case(spec_overrides..., rows=...) -> spec path in a fresh directory."""
    counter = {"n": 0}

    def make(rows: dict | None = None, schema: pa.Schema | None = None, **overrides) -> Path:
        counter["n"] += 1
        return write_case(tmp_path / f"case{counter['n']}", small_spec(**overrides), rows, schema)

    return make


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on 127.0.0.1 for the whole session (see tests/postgres.py)."""
    from .postgres import start_server, stop_server

    server = start_server()
    yield server
    stop_server(server)

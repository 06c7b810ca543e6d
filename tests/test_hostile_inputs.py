"""Hostile or careless inputs, specs and command lines (issue 18): every input file read exactly once,
names that cannot leave the release, bounded numbers and nesting, no credential published, private
internal reports, and one-line errors instead of tracebacks."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from sqlalchemy.engine import make_url

from dprelease.accounting.ledger import open_ledger, set_budget
from dprelease.accounting.redact import shown
from dprelease.pipelines.provenance import WITHHELD, beam_options, ledger_kind, location, run_invocation
from dprelease.pipelines.run import run_release

from .conftest import GEO_LEAVES, small_spec, write_case


def cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, **kwargs)


def _rows(n: int, first: int = 0) -> dict:
    return {"pid": list(range(first, first + n)), "geo": [GEO_LEAVES[i % 6] for i in range(n)],
            "age": [i % 90 for i in range(n)], "sex": ["F", "M"] * (n // 2)}


def _directory_case(tmp_path: Path) -> Path:
    """A spec whose input is a directory holding one Parquet file of 10 persons."""
    spec = write_case(tmp_path / "case", small_spec(input={"path": "data"}))
    (spec.parent / "data").mkdir()
    pq.write_table(pa.table(_rows(10)), spec.parent / "data" / "a.parquet")
    return spec


def _nation_total(release: Path) -> int:
    return int(pq.read_table(release / "measurements" / "pop.nation.parquet").column("noisy_count")[0].as_py())


# ---- 3. every input file read exactly once ------------------------------------------------------------------------

def test_a_symlink_loop_in_the_input_directory_is_refused(tmp_path):
    """Main read a directory holding a.parquet and `loop -> .` 41 times (counts x41, exit 0)."""
    spec = _directory_case(tmp_path)
    (spec.parent / "data" / "loop").symlink_to(".")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key")
    assert ran.returncode == 2, ran.stderr
    assert "loop" in ran.stderr and "read once" in ran.stderr
    assert not (tmp_path / "k.key").exists()


def test_two_aliases_of_one_directory_are_refused(tmp_path):
    spec = _directory_case(tmp_path)
    (spec.parent / "data" / "part").mkdir()
    pq.write_table(pa.table(_rows(10, 100)), spec.parent / "data" / "part" / "b.parquet")
    (spec.parent / "data" / "alias").symlink_to("part")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key")
    assert ran.returncode == 2 and "alias" in ran.stderr and "part" in ran.stderr, ran.stderr


def test_a_file_linked_twice_is_refused(tmp_path):
    spec = _directory_case(tmp_path)
    (spec.parent / "data" / "again.parquet").symlink_to("a.parquet")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key")
    assert ran.returncode == 2 and "again.parquet" in ran.stderr, ran.stderr


# ---- 14. names starting with _ or . are data; only known markers are skipped, and named -----------------------------

def test_underscore_and_dot_files_are_read_and_markers_skipped_by_name(tmp_path):
    """Main skipped `_part.parquet` and `.part.parquet` silently (half the rows counted, exit 0)."""
    spec = _directory_case(tmp_path)
    data = spec.parent / "data"
    pq.write_table(pa.table(_rows(10, 100)), data / "_part.parquet")
    pq.write_table(pa.table(_rows(10, 200)), data / ".part.parquet")
    (data / "_SUCCESS").write_text("")
    (data / ".a.parquet.crc").write_bytes(b"crc")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 0, ran.stderr
    assert "skipped 2 marker file(s)" in ran.stderr and "_SUCCESS" in ran.stderr and ".a.parquet.crc" in ran.stderr
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.source import open_input
    from dprelease.pipelines.spec import load_spec

    parsed, base = load_spec(spec)
    source = open_input(build_plan(parsed, base), base)
    assert sorted(Path(f).name for f in source.files()) == [".part.parquet", "_part.parquet", "a.parquet"]


def test_a_hidden_file_that_is_not_data_is_refused_naming_it(tmp_path):
    spec = _directory_case(tmp_path)
    (spec.parent / "data" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key")
    assert ran.returncode == 2 and ".DS_Store" in ran.stderr, ran.stderr


# ---- 5. unit ids that are not ids -----------------------------------------------------------------------------------

def test_a_float_unit_column_is_refused_at_the_schema_check(case, tmp_path):
    """NaN unit ids would group several people into one unit: float unit columns never reach bounding."""
    spec = case(rows={"pid": [1.0, float("nan"), float("nan")], "geo": GEO_LEAVES[:3], "age": [1, 2, 3],
                      "sex": ["F", "M", "F"]})
    ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / "k.key")
    assert ran.returncode == 2 and "privacy_unit 'pid'" in ran.stderr and "double" in ran.stderr, ran.stderr
    assert not (tmp_path / "k.key").exists()


def _two_file_case(tmp_path: Path, first: pa.DataType, second: pa.DataType, name: str) -> Path:
    """The 10 persons of `_rows` in two Parquet files, their unit ids typed `first` in one and `second` in the
    other (persons 2 and 7 with two records each, one in each file)."""
    spec = write_case(tmp_path / name, small_spec(input={"path": "data"}, contribution={"max_records_per_unit": 1}))
    (spec.parent / "data").mkdir()
    rows = pa.table(_rows(10))
    rows = rows.set_column(0, "pid", pa.array([0, 1, 2, 3, 4, 5, 6, 7, 2, 7]))
    for label, kind, part in (("a", first, rows.slice(0, 5)), ("b", second, rows.slice(5))):
        pq.write_table(part.set_column(0, "pid", part.column("pid").cast(kind)), spec.parent / "data" / f"{label}.parquet")
    return spec


def test_units_typed_differently_per_file_are_grouped_as_one_type(tmp_path):
    """int32 ids in one file and uint32 in another are one unit per value (bounded together: the release is the
    one of int64 ids in both, same key); text in one and integers in another, or uint64 and int64, cannot be
    grouped: refused at the schema check (exit 2), naming the unit and each kind, before any key is made."""
    from dprelease.pipelines.engines.base import no_progress
    from dprelease.pipelines.engines.embedded import EmbeddedEngine
    from dprelease.pipelines.plan import build_plan
    from dprelease.pipelines.source import open_input
    from dprelease.pipelines.spec import load_spec
    from dprelease.transforms.csprng import ReleaseKey

    key, counts = ReleaseKey.generate(), []
    for first, second in ((pa.int32(), pa.uint32()), (pa.int64(), pa.int64())):
        spec, base = load_spec(_two_file_case(tmp_path, first, second, f"{first}-{second}"))
        plan = build_plan(spec, base)
        counts.append(EmbeddedEngine(workers=1).true_counts(plan, open_input(plan, base), key, no_progress))
    assert counts[0].keys() == counts[1].keys()
    assert all(counts[0][name].tolist() == counts[1][name].tolist() for name in counts[0])
    assert int(counts[0]["pop.nation"][0]) == 8  # 10 records, 8 units, one record kept per unit
    ran = cli("run", _two_file_case(tmp_path, pa.int32(), pa.uint32(), "run"), "--no-ledger", "--key-file",
              tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 0, ran.stderr
    for first, second, kinds in ((pa.string(), pa.int64(), "text in"), (pa.uint64(), pa.int64(), "uint64 in")):
        spec = _two_file_case(tmp_path, first, second, f"refused-{first}")
        ran = cli("run", spec, "--no-ledger", "--key-file", tmp_path / f"{first}.key")
        assert ran.returncode == 2 and "privacy_unit 'pid'" in ran.stderr and kinds in ran.stderr, ran.stderr
        assert not (tmp_path / f"{first}.key").exists()


# ---- 13. names become file names: restricted, and joined paths checked -----------------------------------------------

def test_a_column_name_that_leaves_the_release_is_refused(tmp_path):
    """Main wrote domains/../../../x.txt outside the release for a geography column named ../../../x."""
    spec = small_spec()
    spec["columns"]["../../../x"] = json.loads(json.dumps(spec["columns"]["geo"]))
    path = write_case(tmp_path / "case", spec)
    ran = cli("run", path, "--no-ledger", "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 2 and "columns" in ran.stderr and "file names" in ran.stderr, ran.stderr
    assert not (tmp_path / "x.txt").exists() and not list(tmp_path.rglob("x.txt"))


@pytest.mark.parametrize("field,value", [("levels", {"../up": 2, "county": 5, "tract": 11})])
def test_a_level_name_that_is_not_a_name_is_refused(tmp_path, field, value):
    spec = small_spec()
    spec["columns"]["geo"] = {**spec["columns"]["geo"], field: value}
    ran = cli("plan", write_case(tmp_path / "case", spec))
    assert ran.returncode == 2 and "level names" in ran.stderr, ran.stderr


def test_writers_refuse_a_path_that_leaves_the_directory(tmp_path):
    from dprelease.pipelines.storage import inside

    with pytest.raises(ValueError):
        inside(tmp_path, "../escape")
    with pytest.raises(ValueError):
        inside(tmp_path, "/etc/passwd")
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(ValueError):
        inside(tmp_path, "link/etc")
    assert inside(tmp_path, "tables/pop.state") == tmp_path / "tables" / "pop.state"


# ---- 4. invariants need the replace relation ------------------------------------------------------------------------

def test_invariants_under_add_remove_are_refused(case):
    ran = cli("plan", case(invariants=["pop.state"]))
    assert ran.returncode == 2 and "need neighbouring: replace" in ran.stderr, ran.stderr
    assert cli("plan", case(invariants=["pop.state"], neighbouring="replace")).returncode == 0


def test_an_invariant_states_which_neighbours_the_guarantee_covers(case, tmp_path):
    result = run_release(case(invariants=["pop.state"], neighbouring="replace"), key_file=tmp_path / "k.key")
    note = json.loads((result.release_dir / "manifest.json").read_text())["invariants"][0]["note"]
    assert "replace one unit by another whose records fall in the same cells" in note


# ---- 17, 22. bounded numbers and nesting: an error in seconds, never a traceback -------------------------------------

@pytest.mark.parametrize("weight", ["1e-100000000", "1e999999999", "1" * 300, "1/" + "7" * 300])
def test_a_budget_weight_with_a_huge_exact_value_is_a_spec_error(case, weight):
    spec = yaml.safe_load(case().read_text())
    spec["queries"][0]["weight"] = weight
    path = case()
    path.write_text(yaml.safe_dump(spec))
    ran = cli("plan", path, timeout=60)
    assert ran.returncode == 2 and "queries[0].weight" in ran.stderr and "Traceback" not in ran.stderr, ran.stderr


def test_a_5000_digit_integer_in_yaml_is_a_spec_error(case):
    path = case()
    path.write_text(path.read_text().replace("max_records_per_unit: 1", "max_records_per_unit: " + "9" * 5000))
    ran = cli("plan", path, timeout=60)
    assert ran.returncode == 2 and "more than 100 digits" in ran.stderr and "set_int_max_str_digits" not in ran.stderr


@pytest.mark.parametrize("command", ["plan", "run"])
def test_deeply_nested_yaml_is_a_spec_error(case, tmp_path, command):
    """Main printed a 2,996-line RecursionError traceback for plan and exited 1 for run."""
    path = case()
    path.write_text(path.read_text() + "extra: " + "[" * 100_000 + "]" * 100_000 + "\n")
    args = [command, path] + (["--no-ledger", "--key-file", tmp_path / "k.key"] if command == "run" else [])
    ran = cli(*args, timeout=60)
    assert ran.returncode == 2 and "nested" in ran.stderr and len(ran.stderr.splitlines()) < 5, ran.stderr[-500:]


# ---- 12. credentials: never published ---------------------------------------------------------------------------------

PASSWORDS = ["Zq9p/ss", "Zq9a?b#c d", "Zq9x@y9Q", "Zq9%2Fq", "Zq9semi;colon&amp", "Zq9tab\there"]
"""Passwords SQLAlchemy accepts unencoded in a URL (main published the first two verbatim)."""


@pytest.mark.parametrize("password", PASSWORDS)
def test_a_ledger_password_with_url_characters_is_never_shown(password):
    url = f"postgresql+psycopg://agency:{password}@db.example:5432/ledger"
    parsed = make_url(url).password  # what SQLAlchemy would connect with
    assert "Zq9" not in shown(url) and parsed not in shown(url), shown(url)
    assert shown(url).endswith("db.example:5432/ledger")
    assert ledger_kind(url) == "postgresql+psycopg"  # all a manifest says of a ledger


def test_a_password_as_a_percent_encoded_query_key_is_never_shown():
    """Issue 29 item 7: `?pass%77ord=` is decoded by SQLAlchemy to `password` (and connected with)."""
    url = "postgresql+psycopg://agency@db.example/ledger?pass%77ord=Zq9secret"
    assert make_url(url).query.get("password") == "Zq9secret"
    assert "Zq9" not in shown(url) and "Zq9" not in str(run_invocation("test", engine="embedded", ledger=url))


SECRET_OPTIONS = [
    "--sdk_location=https://bucket.s3.amazonaws.com/sdk.tar.gz?X-Amz-Credential=Zq9A&X-Amz-Security-Token=Zq9B"
    "&X-Amz-Signature=Zq9C",
    "--temp_location=/tmp/x?access_token=Zq9D",
    "--experiments=use_runner_v2,token=Zq9E",
    "--staging_location=https://storage.googleapis.com/b/x?X-Goog-Credential=Zq9F&X-Goog-Signature=Zq9G",
    "--s3_secret_access_key=Zq9H", "--azure_connection_string", "DefaultEndpointsProtocol=https;AccountKey=Zq9I",
    "--hdfs_user", "Zq9J", "--flink_master=agency:Zq9K@host:8081", "--subnetwork=https://u:Zq9L@example/x",
]
"""Credentials inside option values, allow-listed names among them (issue 29 item 8)."""


def test_beam_options_publish_typed_values_only():
    published = beam_options([*SECRET_OPTIONS, "--flink_master=host:8081", "--parallelism=8",
                              "--temp_location=gs://bucket/tmp", "--num_workers=x9"])
    text = json.dumps(published)
    assert "Zq9" not in text, text
    assert published["flink_master"] == "host:8081" and published["parallelism"] == 8
    assert published["temp_location"] == "gs://bucket/tmp" and published["num_workers"] == WITHHELD
    assert published["experiments"] == ["use_runner_v2", WITHHELD]
    assert published["sdk_location"] == WITHHELD and published["other_options"] == 3  # names off the list: counted
    assert location("abfs://acct:Zq9TOK@container/rel") == WITHHELD and "Zq9" not in shown("abfs://acct:Zq9TOK@c/r")


def test_the_manifest_never_holds_a_secret_of_its_invocation(case, tmp_path):
    """End to end: secrets in the ledger URL, the output URI and pipeline options never reach the manifest."""
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(5))
    invocation = run_invocation("test", engine="embedded", ledger="postgresql://agency:p/ss w?rd#1@db/ledger",
                                out_dir="s3://bkt/out?X-Amz-Signature=Zq9S", beam_options_given=SECRET_OPTIONS)
    result = run_release(case(), ledger=book, key_file=tmp_path / "k.key", invocation=invocation)
    text = (result.release_dir / "manifest.json").read_text()
    assert "p/ss" not in text and "w?rd" not in text and "Zq9" not in text
    assert json.loads(text)["provenance"]["invocation"]["options"]["out"] == WITHHELD


def test_an_error_naming_a_uri_shows_no_credentials(case, tmp_path):
    """Issue 29 item 9: user info anywhere in a URI is hidden in messages (only the query was stripped)."""
    ran = cli("run", case(), "--no-ledger", "--out", "abfs://acct:Zq9TOK@container/rel")
    assert ran.returncode == 2 and "Zq9" not in ran.stderr and "container/rel" in ran.stderr, ran.stderr


# ---- 15. the internal validation report is private -------------------------------------------------------------------

def test_the_validation_report_and_suite_are_owner_only(case, tmp_path):
    internal = tmp_path / "internal"
    run_release(case(), key_file=tmp_path / "k.key", internal_dir=internal)
    files = sorted(internal.iterdir())
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files]


# ---- 22. one line, not a traceback; the extra named before any key is written ----------------------------------------

@pytest.mark.parametrize("command", [["ledger", "show", "d"], ["ledger", "reconcile"], ["ledger", "list"],
                                     ["ledger", "set-budget", "d", "--rho", "1"]])
def test_an_unreachable_ledger_database_is_one_line(command):
    ran = cli(*command, "--ledger", "postgresql+psycopg://u:secret@127.0.0.1:9/nothing", timeout=120)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert "secret" not in ran.stderr and "cannot be used" in ran.stderr


def test_a_missing_engine_extra_is_named_before_any_key_is_written(case, tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pyspark.py").write_text("raise ImportError('no pyspark here', name='pyspark')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow))
    ran = cli("run", case(), "--engine", "spark", "--no-ledger", "--key-file", tmp_path / "k.key", env=env)
    assert ran.returncode == 2 and 'pip install "dprelease[spark]"' in ran.stderr, ran.stderr
    assert not (tmp_path / "k.key").exists()


def test_the_cell_limit_names_the_largest_table_by_its_entries(tmp_path):
    spec = small_spec(columns={**small_spec()["columns"],
                               "income": {"type": "integer", "min": 0, "max": 10**6, "clamp": [0, 10**6],
                                          "bins": [0, 10, 10**6 + 1]}},
                      queries=[{"name": "pop", "kind": "histogram", "by": ["geo.tract", "age"]},
                               {"name": "q", "kind": "quantile", "column": "income", "by": ["geo.tract"],
                                "q": [0.5], "candidates": list(range(0, 20_000, 2))}])
    ran = cli("plan", write_case(tmp_path / "case", spec), "--max-cells", 1000)
    assert ran.returncode == 2 and "largest table 'q'" in ran.stderr and "quantile buckets" in ran.stderr, ran.stderr


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_text_values_are_coded_alike_by_the_vectorised_lookup_and_by_their_text(kind):
    """A text column's dictionary is matched as UTF-8 bytes in one lookup; the codes equal matching each value's
    text, with nulls, misses, non-ASCII values and text that is not valid UTF-8 all handled as before."""
    from dprelease.transforms import encode

    values = ("F", "é", "01001000100", "M")
    raw = [b"\xc3\xa9", None, b"F", b"x", b"\xffF", b"01001000100", b"\xc3", b"M", b"", b"F"]
    column = pa.array(raw, pa.large_binary() if kind == pa.large_string() else pa.binary()).view(kind)
    texts = [None if v is None else encode._decoded(v) for v in raw]
    expected = [values.index(t) if t in values else encode.INVALID for t in texts]
    assert encode._lookup_codes(column, values).tolist() == expected
    assert encode._lookup_codes(column.dictionary_encode(), values).tolist() == expected
    assert encode._lookup_codes(pa.chunked_array([column[:4], column[4:]]), values).tolist() == expected

"""The hostile-surface matrix: every entry point against every hostile case (issue 29).

An entry point is one line of ENTRY_POINTS: a CLI command line or a Python expression over the API, whose
placeholders ({spec}, {release}, {out_file}, ...) name the roles its arguments play. A case is one entry of CASES:
for some roles, a hostile value (a FIFO, /dev/zero, a link out, `..` names on disk and in an object store, an
existing target, a target inside a published release, an oversized, deeply nested or huge-number file, terminal
escapes, secrets in URLs) and what must follow (refused, or harmless). The matrix runs every (entry point, case,
role) the entry point takes, each in a forked worker with bounded memory and time (`hostile_worker`); every cell
also demands no traceback, no raw escape sequence on the console, no secret printed or written, nothing outside
touched. A new entry point is one line here, and inherits every case.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import pyarrow.fs as pafs
import pytest

from dprelease.accounting.ledger import open_ledger, set_budget

from .conftest import small_spec, write_case

moto_server = pytest.importorskip("moto.server")

CLI, API = "cli", "api"


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str
    template: tuple | str
    verifies: bool = False
    """Verifies the release it is given (verify, report, synthesize, attack): a release that is not what it claims
    is a mismatch or an error (non-zero), never OK."""
    jvm: bool = False
    """Launches a JVM (Spark): run without the cell's address-space bound, its console checked as its output."""
    reads_tables: bool = False
    """Reads the tables of the release it is given (`.tables`): a table file that is not a regular file inside
    the release is an error."""

    @property
    def roles(self) -> set[str]:
        text = " ".join(self.template) if self.kind == CLI else self.template
        return {role for role in ROLES if "{" + role + "}" in text}


ROLES = ("spec", "data", "data_uri", "key", "sign_key", "public_key", "ledger", "book", "dataset", "release",
         "release_uri", "out_dir", "out_file", "out_uri", "out_uri_overwrite", "internal", "temp_location")

ENTRY_POINTS = [
    Entry("plan", CLI, ("plan", "{spec}")),
    Entry("run", CLI, ("run", "{spec}", "--input", "{data}", "--key-file", "{key}", "--out", "{out_dir}", "--ledger",
                       "{ledger}", "--sign-key", "{sign_key}", "--internal-dir", "{internal}")),
    Entry("run from a store", CLI, ("run", "{spec}", "--input", "{data_uri}", "--no-ledger", "--key-file", "{key}",
                                    "--out", "{out_dir}")),
    Entry("run to a store", CLI, ("run", "{spec}", "--no-ledger", "--key-file", "{key}", "--out", "{out_uri}")),
    Entry("run --overwrite to a store", CLI, ("run", "{spec}", "--no-ledger", "--key-file", "{key}", "--overwrite",
                                              "--out", "{out_uri_overwrite}")),
    Entry("run on beam", CLI, ("run", "{spec}", "--engine", "beam", "--input", "{data}", "--key-file", "{key}", "--out",
                               "{out_dir}", "--ledger", "{ledger}", "--internal-dir", "{internal}")),
    Entry("run on beam from and to a store", CLI, ("run", "{spec}", "--engine", "beam", "--input", "{data_uri}",
                                                   "--no-ledger", "--key-file", "{key}", "--out", "{out_uri}")),
    Entry("run on beam with a --temp_location", CLI, ("run", "{spec}", "--engine", "beam", "--input", "{data}",
                                                      "--no-ledger", "--key-file", "{key}", "--out", "{out_dir}", "--",
                                                      "--temp_location={temp_location}")),
    Entry("run on spark", CLI, ("run", "{spec}", "--engine", "spark", "--input", "{data}", "--key-file", "{key}",
                                "--out", "{out_dir}", "--ledger", "{ledger}", "--internal-dir", "{internal}"), jvm=True),
    Entry("run on spark from and to a store", CLI, ("run", "{spec}", "--engine", "spark", "--input", "{data_uri}",
                                                    "--no-ledger", "--key-file", "{key}", "--out", "{out_uri}"),
          jvm=True),
    Entry("validate", CLI, ("validate", "{spec}", "--input", "{data}", "--internal-dir", "{internal}")),
    Entry("verify", CLI, ("verify", "{release}", "--public-key", "{public_key}", "--ledger", "{book}"), verifies=True),
    Entry("verify a store", CLI, ("verify", "{release_uri}"), verifies=True),
    Entry("verify --recompute", CLI, ("verify", "{release}", "--recompute"), verifies=True),
    Entry("report", CLI, ("report", "{release}", "--out", "{out_file}", "--public-key", "{public_key}", "--ledger",
                          "{book}"), verifies=True),
    Entry("report a store", CLI, ("report", "{release_uri}", "--out", "{out_file}"), verifies=True),
    Entry("synthesize", CLI, ("synthesize", "{release}", "--out", "{out_file}"), verifies=True),
    Entry("synthesize a store", CLI, ("synthesize", "{release_uri}", "--out", "{out_file}"), verifies=True),
    Entry("attack", CLI, ("attack", "{release}", "--data", "{data}", "--internal-dir", "{internal}", "--max-units",
                          "1", "--time-limit", "1"), verifies=True),
    Entry("demo-data", CLI, ("demo-data", "--rows", "10", "--out", "{out_file}")),
    Entry("ledger set-budget", CLI, ("ledger", "set-budget", "{dataset}", "--epsilon", "1", "--ledger", "{ledger}")),
    Entry("ledger show", CLI, ("ledger", "show", "{dataset}", "--ledger", "{book}")),
    Entry("ledger list", CLI, ("ledger", "list", "--ledger", "{book}")),
    Entry("ledger reconcile", CLI, ("ledger", "reconcile", "--dry-run", "--ledger", "{book}")),
    Entry("Release.from_yaml", API, "Release.from_yaml({spec}).release_id"),
    Entry("Release.plan", API, "Release.from_yaml({spec}).plan()"),
    Entry("Release.run", API, "Release.from_yaml({spec}).run({data}, ledger={ledger}, out_dir={out_dir}, "
                              "key_file={key}, internal_dir={internal}, sign_key={sign_key}).release_id"),
    Entry("Release.publish", API, "Release.from_yaml({spec}).publish({data}, ledger={ledger}, out_dir={out_dir}, "
                                  "key_file={key}).release_dir"),
    Entry("Release.run to a store", API, "Release.from_yaml({spec}).run(ledger=None, out_dir={out_uri}, "
                                         "key_file={key}).release_id"),
    Entry("Release.validate", API, "Release.from_yaml({spec}).validate({internal}, {data})"),
    Entry("ReleaseResult.open", API, "ReleaseResult.open({release}).manifest['release_id']"),
    Entry("ReleaseResult.tables", API, "ReleaseResult.open({release}).tables", reads_tables=True),
    Entry("ReleaseResult.open a store", API, "ReleaseResult.open({release_uri}).tables", reads_tables=True),
    Entry("ReleaseResult.coding_warnings", API, "ReleaseResult.open({release}).coding_warnings", reads_tables=True),
    Entry("ReleaseResult.verify", API, "ReleaseResult.open({release}).verify({public_key}, {book})", verifies=True),
    Entry("verify", API, "commands.verify({release}, {public_key}, {book})", verifies=True),
    Entry("write_report", API, "commands.write_report({release}, {out_file}, public_key={public_key})[1]",
          verifies=True),
    Entry("synthesize", API, "commands.synthesize({release}, {out_file}).path", verifies=True),
    Entry("attack", API, "commands.attack({release}, {data}, {internal}, max_units=1, time_limit=1)", verifies=True),
    Entry("demo_data", API, "commands.demo_data(10, {out_file})"),
    Entry("Ledger.set_budget", API, "Ledger({ledger}).set_budget({dataset}, epsilon=1)"),
    Entry("Ledger.history", API, "Ledger({book}).history({dataset})"),
    Entry("Ledger.reconcile", API, "Ledger({book}).reconcile(dry_run=True)"),
    Entry("PublishedTables.from_spec", API, "PublishedTables.from_spec({spec})"),
]


# ---- the world every cell starts from ---------------------------------------------------------------------------

@dataclass
class World:
    root: Path
    spec: Path
    data: Path
    ledger: Path
    sign_key: Path
    public_key: Path
    release: Path
    endpoint: str
    outside: Path
    """A file outside everything (its bytes must never change, nor be printed)."""
    outside_dir: Path

    def uri(self, path: str) -> str:
        return f"s3://{path}?endpoint_override={self.endpoint}&scheme=http"

    @property
    def store(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", allow_bucket_creation=True)

    def put(self, name: str, data: bytes) -> None:
        with self.store.open_output_stream(name) as handle:
            handle.write(data)

    def put_raw(self, name: str, data: bytes) -> None:
        """An object under exactly this key (pyarrow would normalise `a/../b` away on write; a store keeps it)."""
        import boto3

        bucket, key = name.split("/", 1)
        boto3.client("s3", endpoint_url=f"http://{self.endpoint}", region_name="us-east-1").put_object(
            Bucket=bucket, Key=key, Body=data)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dprelease.pipelines.run import run_release

    root = tmp_path_factory.mktemp("world")
    spec = write_case(root / "case", small_spec())
    signer = Ed25519PrivateKey.generate()
    (root / "agency.pem").write_bytes(signer.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    (root / "agency.pub.pem").write_bytes(signer.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    ledger = root / "ledger.sqlite"
    set_budget(open_ledger(ledger), "test-data", "epsilon", Fraction(100))
    release = run_release(spec, key_file=root / "world.key", ledger=ledger, out_dir=root / "published",
                          sign_key=root / "agency.pem").release_dir
    (root / "outside.txt").write_text("OUTSIDE-SECRET-7f3a\n")
    (root / "outside-dir").mkdir(mode=0o755)
    os.chmod(root / "outside-dir", 0o755)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port: the system's pick
    server.start()
    port = server.get_host_and_port()[1]
    old_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    made = World(root, spec, spec.parent / "input.parquet", ledger, root / "agency.pem", root / "agency.pub.pem",
                 release, f"127.0.0.1:{port}", root / "outside.txt", root / "outside-dir")
    made.store.create_dir("world")
    made.put("world/in/persons.parquet", made.data.read_bytes())
    for path in sorted(release.rglob("*")):
        if path.is_file() and path.name != "manifest.json":
            made.put(f"world/rel/test-release/{path.relative_to(release).as_posix()}", path.read_bytes())
    made.put("world/rel/test-release/manifest.json", (release / "manifest.json").read_bytes())
    yield made
    server.stop()
    for name, value in old_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def worker(world):
    """The forking worker (`hostile_worker`), started once; it inherits the S3 credentials of the world."""
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("hostile_worker.py"))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ})
    assert json.loads(process.stdout.readline()) == {"ready": True}

    def run(cell: dict) -> dict:
        process.stdin.write(json.dumps(cell) + "\n")
        process.stdin.flush()
        return json.loads(process.stdout.readline())

    yield run
    process.stdin.close()
    process.wait(timeout=60)


# ---- hostile values ---------------------------------------------------------------------------------------------

def _copy_release(world: World, cell: Path) -> Path:
    copy = cell / "copy" / "test-release"
    shutil.copytree(world.release, copy)
    return copy


def _release_with(world: World, cell: Path, edit: Callable[[Path], None]) -> Path:
    copy = _copy_release(world, cell)
    edit(copy)
    return copy


def _manifest_bytes(data: bytes) -> Callable[[Path], None]:
    def edit(copy: Path) -> None:
        (copy / "manifest.json").write_bytes(data)
    return edit


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


def _link(path: Path, target: Path | str) -> Path:
    path.symlink_to(target)
    return path


def _private_file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


def _store_release_with_odd_name(world: World, cell: Path) -> str:
    prefix = f"world/cells/{cell.name}/rel/test-release"
    for path in sorted(world.release.rglob("*")):
        if path.is_file():
            world.put(f"{prefix}/{path.relative_to(world.release).as_posix()}", path.read_bytes())
    world.put_raw(f"{prefix}/tables/../../outside", b"x")
    return world.uri(prefix)


def _store_input_with_odd_name(world: World, cell: Path) -> str:
    prefix = f"world/cells/{cell.name}/in"
    data = world.data.read_bytes()
    world.put(f"{prefix}/persons.parquet", data)
    world.put_raw(f"{prefix}/../in/persons.parquet", data)  # read twice once normalised
    return world.uri(prefix + "/")


def _store_target_with_odd_name(world: World, cell: Path) -> str:
    prefix = f"world/cells/{cell.name}/out"
    world.put(f"world/cells/{cell.name}/victim/manifest.json", b"{}")
    world.put_raw(f"{prefix}/test-release/../../victim/manifest.json", b"attacker")
    return world.uri(prefix + "/")


def _existing_release_dir(cell: Path) -> Path:
    (cell / "out" / "test-release").mkdir(parents=True)
    (cell / "out" / "test-release" / "notes.txt").write_text("KEEP")
    return cell / "out"


def _inputs(cell: Path) -> Path:
    """Where a case puts a hostile input that holds a secret itself (not searched for the secret afterwards)."""
    folder = cell / INPUTS
    folder.mkdir(exist_ok=True)
    return folder


def _private_release(world: World, cell: Path) -> Path:
    """A copy of the release made private (an embargoed release): a directory for confidential files it is not."""
    copy = _copy_release(world, cell)
    os.chmod(copy, 0o700)
    return copy


def _kept_file(path: Path) -> Path:
    path.write_text("KEEP")
    return path


def _release_dir_linked(cell: Path, target: Path) -> Path:
    """An output directory whose release directory is a link (to a directory outside)."""
    (cell / "out").mkdir()
    (cell / "out" / "test-release").symlink_to(target)
    return cell / "out"


def _existing_dir(path: Path) -> Path:
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    return path


SECRET = "Zq9SECRET"
INPUTS = "hostile-inputs"
DEEP = b"[" * 200_000 + b"]" * 200_000
HUGE = b'{"manifest_version": ' + b"9" * 200_000 + b"}"


@dataclass(frozen=True)
class Case:
    name: str
    values: dict[str, Callable]
    """role -> make(world, cell) -> the hostile value of that role."""
    expect: str | dict
    """'refused': non-zero exit / DPReleaseError; 'checked': entries that verify refuse (and those that use a
    poisoned input or output: never read or written), others may succeed, never reading outside; 'read': those
    and the readers of tables refuse; 'harmless': any outcome but a crash (what must hold is in the common
    checks); a dict: per role, 'refused' where not given."""

    def expectation(self, role: str) -> str:
        return self.expect if isinstance(self.expect, str) else self.expect.get(role, "refused")


CASES = [
    Case("clean", {"": lambda w, c: None}, "ok"),
    Case("fifo", {
        "spec": lambda w, c: _fifo(c / "spec.yaml"), "data": lambda w, c: _fifo(c / "persons.parquet"),
        "key": lambda w, c: _fifo(c / "fifo.key"), "sign_key": lambda w, c: _fifo(c / "sign.pem"),
        "public_key": lambda w, c: _fifo(c / "public.pem"), "temp_location": lambda w, c: _fifo(c / "beam-temp"),
        "release": lambda w, c: _release_with(w, c, lambda r: (r.joinpath("manifest.json").unlink(),
                                                                 _fifo(r / "manifest.json")))}, "refused"),
    Case("dev-zero", {
        "spec": lambda w, c: _link(c / "spec.yaml", "/dev/zero"), "data": lambda w, c: _link(c / "p.parquet", "/dev/zero"),
        "key": lambda w, c: _link(c / "zero.key", "/dev/zero"), "sign_key": lambda w, c: _link(c / "s.pem", "/dev/zero"),
        "public_key": lambda w, c: _link(c / "p.pem", "/dev/zero"),
        "temp_location": lambda w, c: _link(c / "beam-temp", "/dev/zero"),
        "release": lambda w, c: _release_with(w, c, lambda r: (r.joinpath("manifest.json").unlink(),
                                                                 _link(r / "manifest.json", "/dev/zero")))}, "refused"),
    Case("link-out", {
        "spec": lambda w, c: _link(c / "spec.yaml", w.outside),
        "release": lambda w, c: _release_with(w, c, lambda r: (r.joinpath("tables/pop.nation.parquet").unlink(),
                                                                 _link(r / "tables/pop.nation.parquet", w.data))),
        "out_file": lambda w, c: _link(c / "out.parquet", w.outside),
        "out_dir": lambda w, c: _release_dir_linked(c, w.outside_dir),
        "internal": lambda w, c: _link(c / "internal", w.outside_dir),
        "temp_location": lambda w, c: _link(c / "beam-temp", w.outside_dir)},
         # a --temp_location is a parent the run makes its own private directory in (and removes): through a link
         # (macOS's /tmp is one) as anywhere, nothing of it may stay there
         {"release": "read", "temp_location": "harmless"}),
    Case("dotdot-on-disk", {
        "release": lambda w, c: _release_with(w, c, lambda r: _relist(r, "../../outside.txt", w.outside))},
         "checked"),
    Case("dotdot-in-store", {
        "data_uri": _store_input_with_odd_name, "release_uri": _store_release_with_odd_name,
        "out_uri_overwrite": _store_target_with_odd_name,
        "out_uri": lambda w, c: w.uri(f"world/cells/{c.name}/../other/"),
        "temp_location": lambda w, c: w.uri(f"world/cells/{c.name}/../tmp/")}, {"release_uri": "checked"}),
    Case("mistyped-ledger", {"book": lambda w, c: f"sqlite:///{c}/no/such/dir/ledger.db"}, "refused"),
    Case("existing-target", {
        "out_file": lambda w, c: _kept_file(c / "out.parquet"),
        "out_dir": lambda w, c: _existing_release_dir(c),
        "internal": lambda w, c: _existing_dir(c / "internal"),
        "out_uri": lambda w, c: w.put(f"world/cells/{c.name}/out/test-release/notes.txt", b"KEEP")
        or w.uri(f"world/cells/{c.name}/out/")}, "refused"),
    Case("inside-a-release", {
        "out_file": lambda w, c: _copy_release(w, c) / "out.parquet",
        "out_dir": lambda w, c: _copy_release(w, c),
        "internal": lambda w, c: _copy_release(w, c) / "internal",
        "key": lambda w, c: _copy_release(w, c) / "k.key",
        "ledger": lambda w, c: _copy_release(w, c) / "ledger.sqlite",
        "temp_location": lambda w, c: _copy_release(w, c) / "beam-temp",
        "out_uri": lambda w, c: w.uri("world/rel/test-release/")}, "refused"),
    Case("a-release-itself", {"internal": lambda w, c: _private_release(w, c)}, "refused"),
    Case("secrets-in-the-spec", {
        "spec": lambda w, c: _private_file(_inputs(c) / "spec.yaml", w.spec.read_bytes().replace(
            b"path: input.parquet", f"path: 's3://agency:{SECRET}@bucket/in/?secret_key={SECRET}'".encode()))},
         "refused"),
    Case("oversized", {
        "spec": lambda w, c: _private_file(c / "spec.yaml", b"# " + b"z" * (2 << 20)),
        "key": lambda w, c: _private_file(c / "big.key", b"0" * (1 << 20)),
        "sign_key": lambda w, c: _private_file(c / "s.pem", b"0" * (1 << 20)),
        "public_key": lambda w, c: _private_file(c / "p.pem", b"0" * (1 << 20)),
        "release": lambda w, c: _release_with(w, c, lambda r: os.truncate(r / "manifest.json", 65 << 20))},
         "refused"),
    Case("deeply-nested", {
        "spec": lambda w, c: _private_file(c / "spec.yaml", b"a: " + DEEP[:2000] + DEEP[-2000:]),
        "release": lambda w, c: _release_with(w, c, _manifest_bytes(DEEP))}, "refused"),
    Case("huge-number", {
        "spec": lambda w, c: _private_file(c / "spec.yaml", w.spec.read_bytes().replace(
            b"epsilon: 1", b"epsilon: 1" + b"0" * 200_000)),
        "release": lambda w, c: _release_with(w, c, _manifest_bytes(HUGE))}, "refused"),
    Case("terminal-escapes", {
        "dataset": lambda w, c: "\x1b]0;pwned\x07\x1b[2J",
        "spec": lambda w, c: _private_file(c / "spec.yaml", w.spec.read_bytes().replace(
            b"release_id: test-release", b'release_id: "\\e[2Jx"')),
        "release": lambda w, c: _release_with(w, c, lambda r: _edit_manifest(r, release_id="\x1b[2J\x1b]0;x\x07"))},
         "harmless"),
    Case("secrets-in-urls", {
        "ledger": lambda w, c: f"postgresql+psycopg://agency:{SECRET}PW@127.0.0.1:9/l?pass%77ord={SECRET}Q",
        "book": lambda w, c: f"postgresql+psycopg://agency:{SECRET}PW@127.0.0.1:9/l?pass%77ord={SECRET}Q",
        "out_uri": lambda w, c: w.uri(f"world/cells/{c.name}/") + f"&X-Amz-Signature={SECRET}",
        "data_uri": lambda w, c: f"s3://agency:{SECRET}@world/in/?endpoint_override={w.endpoint}&scheme=http",
        "release_uri": lambda w, c: w.uri("world/rel/test-release") + f"&token={SECRET}",
        "temp_location": lambda w, c: f"s3://agency:{SECRET}@world/tmp/?endpoint_override={w.endpoint}&scheme=http"},
         "harmless"),
]


def _relist(copy: Path, name: str, target: Path) -> None:
    """The release's manifest lists a file outside it (which exists, and holds a secret)."""
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"].append({"path": name, "sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
                              "bytes": target.stat().st_size})
    (copy / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(copy: Path, **fields) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(fields)
    (copy / "manifest.json").write_text(json.dumps(manifest))


# ---- the cells ----------------------------------------------------------------------------------------------------

def _valid(world: World, cell: Path, role: str, value_needed: set[str]) -> dict[str, object]:
    """Every role's valid value in a fresh cell (outputs at new places; a fresh ledger with a budget)."""
    values: dict[str, object] = {
        "spec": world.spec, "data": world.data, "key": cell / "k.key", "sign_key": world.sign_key,
        "public_key": world.public_key, "ledger": cell / "ledger.sqlite", "book": world.ledger, "dataset": "test-data",
        "release": world.release, "release_uri": world.uri("world/rel/test-release"),
        "data_uri": world.uri("world/in/"), "out_dir": cell / "out", "out_file": cell / "out.parquet",
        "out_uri": world.uri(f"world/cells/{cell.name}/out/"),
        "out_uri_overwrite": world.uri(f"world/cells/{cell.name}/out/"), "internal": cell / "internal",
        "temp_location": cell / "beam-temp"}
    if "ledger" in value_needed and role != "ledger":
        set_budget(open_ledger(cell / "ledger.sqlite"), "test-data", "epsilon", Fraction(100))
    return values


CELLS = [pytest.param(entry, case, role, id=f"{entry.kind}:{entry.name}|{case.name}|{role or 'all valid'}")
         for entry in ENTRY_POINTS for case in CASES for role in case.values
         if role == "" or role in entry.roles]


def _invocation(entry: Entry, values: dict) -> dict:
    if entry.kind == CLI:
        return {"kind": CLI, "args": [part.format(**{k: str(v) for k, v in values.items()}) for part in entry.template]}
    return {"kind": API, "code": entry.template.format(**{k: repr(str(v)) for k, v in values.items()})}


def _tree_text(directory: Path) -> bytes:
    """Every regular file below `directory` (not following links), concatenated: where a secret must not be."""
    found = []
    for path in directory.rglob("*"):
        if INPUTS in path.parts:
            continue
        if path.is_file() and not path.is_symlink() and path.stat().st_size < (8 << 20):
            found.append(path.read_bytes())
    return b"".join(found)


@pytest.mark.parametrize("entry, case, role", CELLS)
def test_hostile_surface(world, worker, tmp_path, entry, case, role):
    cell = tmp_path
    values = _valid(world, cell, role, entry.roles)
    if role:
        values[role] = case.values[role](world, cell)
    outside_before = world.outside.read_bytes(), os.stat(world.outside_dir).st_mode, sorted(world.outside_dir.iterdir())
    outcome = worker({**_invocation(entry, values), "timeout": 90, "cwd": str(cell), "jvm": entry.jvm})
    shown = f"{entry.kind}:{entry.name} with {case.name} as {role}: {outcome}"
    assert not outcome["hung"], shown
    assert outcome["crash"] is None, shown
    assert outcome["maxrss_mb"] < 1500, shown
    output = outcome["output"]
    assert "Traceback" not in output and "\x1b" not in output, shown
    assert "OUTSIDE-SECRET" not in output, shown
    assert (world.outside.read_bytes(), os.stat(world.outside_dir).st_mode,
            sorted(world.outside_dir.iterdir())) == outside_before, shown
    assert SECRET not in output and SECRET.encode() not in _tree_text(cell), shown
    refused = outcome["rc"] not in (0, None)
    expect = case.expectation(role)
    if expect == "ok":
        assert outcome["rc"] == 0, shown
    elif expect == "refused" or (expect in ("checked", "read") and entry.verifies) \
            or (expect == "read" and entry.reads_tables) or (expect == "checked" and role in ("data_uri", "out_uri_overwrite")):
        assert refused, shown
    _check_after(world, cell, case, role, shown)


def _check_after(world: World, cell: Path, case: Case, role: str, shown: str) -> None:
    """What must still hold once the cell ran: targets kept, releases still whole, victims untouched."""
    from dprelease.pipelines.verify import verify_release

    if case.name == "existing-target" and role == "out_file":
        assert (cell / "out.parquet").read_text() == "KEEP", shown
    if case.name == "existing-target" and role == "out_dir":
        assert [p.name for p in (cell / "out" / "test-release").iterdir()] == ["notes.txt"], shown
    if case.name == "existing-target" and role == "internal":
        assert os.stat(cell / "internal").st_mode & 0o777 == 0o755, shown  # never chmod-ed
    if case.name in ("inside-a-release", "a-release-itself") and role in ("out_file", "out_dir", "internal", "key",
                                                                           "ledger"):
        assert verify_release(cell / "copy" / "test-release").ok, shown
    if case.name == "mistyped-ledger":
        assert not (cell / "no").exists(), shown  # a ledger is never created where a reader was pointed
    if case.name == "dotdot-in-store" and role == "out_uri_overwrite":
        info = world.store.get_file_info(f"world/cells/{cell.name}/victim/manifest.json")
        assert info.type == pafs.FileType.File, shown


def test_the_world_is_untouched_after_the_matrix(world):
    """Runs last in this module: the published release, local and in the store, still verifies."""
    from dprelease.pipelines.commands import verify

    assert verify(world.release).ok
    assert verify(world.uri("world/rel/test-release")).ok


def test_every_entry_point_takes_some_hostile_case():
    """A new entry point is one line of ENTRY_POINTS; this fails if it takes no role a case poisons."""
    for entry in ENTRY_POINTS:
        assert sum(1 for case in CASES for role in case.values if role and role in entry.roles) >= 1, entry.name


@pytest.mark.parametrize("role", ["key", "sign_key", "internal", "ledger"])
def test_a_run_refuses_its_own_files_and_ledger_before_an_engine_starts(tmp_path, monkeypatch, role):
    """The key, signing key, internal directory and ledger of a run are public inputs: one that is refused is
    refused before any engine starts (a Spark or Beam run spent its session's start, 6-14 s, reading the input
    first) and before a record is read."""
    from dprelease import DPReleaseError
    from dprelease.pipelines import run as run_module

    spec = write_case(tmp_path / "case", small_spec())
    started = []
    monkeypatch.setattr(run_module, "make_engine", lambda *args, **kwargs: started.append(args) or 1 / 0)
    options = {"key_file": tmp_path / "k.key", "out_dir": tmp_path / "out", "ledger": None}
    if role == "key":
        options["key_file"] = _fifo(tmp_path / "k.key")
    elif role == "sign_key":
        options["sign_key"] = _private_file(tmp_path / "s.pem", b"not a key")
    elif role == "internal":
        options["internal_dir"] = _link(tmp_path / "internal", tmp_path)
    else:
        options["ledger"] = f"sqlite:///{tmp_path}/a-file/ledger.sqlite"
        (tmp_path / "a-file").write_text("a file, not a directory")
    with pytest.raises(DPReleaseError):
        run_module.run_release(spec, engine="spark", **options)
    assert started == [] and not (tmp_path / "out").exists()

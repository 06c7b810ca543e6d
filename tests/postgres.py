"""A real PostgreSQL server on 127.0.0.1 for the ledger tests (Debian's postgresql package).

Started once per test session in a temporary data directory with trust authentication on loopback,
and stopped at the end. As root, the server runs as the `postgres` user (it refuses to run as root).
Under CI (CI=true) a missing server is a failure, not a skip: `.ci/run` installs the package.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def _binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


class Server:
    """A running server; `url(database)` is a SQLAlchemy URL, `create_database()` a fresh database."""

    def __init__(self, port: int, directory: Path, binaries: Path):
        self.port, self.directory, self.binaries = port, directory, binaries
        self._databases = 0

    def url(self, database: str, password: str | None = None) -> str:
        secret = f":{password}" if password else ""
        return f"postgresql+psycopg://dprelease{secret}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        self._databases += 1
        name = f"ledger{self._databases}"
        subprocess.run(_as_server_user([str(self.binaries / "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                                        "-U", "dprelease", name]), check=True, capture_output=True)
        return name


def start_server():
    binaries = _binaries()
    if binaries is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries not found (.ci/run installs Debian's postgresql)")
        pytest.skip("PostgreSQL server binaries not installed")
    # in the system's temporary directory: a pytest-xdist worker's own TMPDIR is 0700 root, closed to the postgres user
    directory = Path(tempfile.mkdtemp(prefix="dprelease-pg-", dir=os.environ.get("DPRELEASE_TEST_SYSTEM_TMPDIR")))
    data = directory / "data"
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    os.chmod(directory, 0o700)
    subprocess.run(_as_server_user([str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", "dprelease",
                                    "--no-sync"]), check=True, capture_output=True)
    port = _free_port()
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {directory} -c fsync=off"
    subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(data), "-o", options, "-w", "-t", "60",
                                    "-l", str(directory / "server.log"), "start"]), check=True, capture_output=True)
    return Server(port, directory, binaries)


def stop_server(server: Server) -> None:
    subprocess.run(_as_server_user([str(server.binaries / "pg_ctl"), "-D", str(server.directory / "data"),
                                    "-m", "immediate", "-w", "stop"]), capture_output=True)
    time.sleep(0.1)
    shutil.rmtree(server.directory, ignore_errors=True)

"""The hostile-surface matrix's worker: imports dprelease once, then runs each cell in a forked child with bounded
memory (RLIMIT_AS) and a deadline, and reports what happened (one JSON line per cell on stdout).

A cell is {"kind": "cli", "args": [...]} (the CLI through click's runner, in-process) or {"kind": "api", "code":
"..."} (a Python expression over the API), with a timeout in seconds. A cell marked "jvm" (Spark) runs without the
memory bound (a JVM reserves more address space than it uses), with its console in a file that is checked as its
output, and ends as a process would (its JVM gone). The worker holds no threads of its own when
it forks (the S3 test server runs in the pytest process), so a child never inherits a lock held by one.
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback

MEMORY_LIMIT = 3 << 30
"""Address space of a cell (a read that is not bounded, of /dev/zero say, fails here instead of filling RAM)."""


def _imports():
    import great_expectations  # noqa: F401 - slow to import: once, here, not in each cell
    import pandas  # noqa: F401

    import dprelease  # noqa: F401
    from dprelease.pipelines import cli, commands  # noqa: F401
    from dprelease.transforms import beam_release  # noqa: F401


def _namespace() -> dict:
    import dprelease
    from dprelease.pipelines import commands
    from dprelease.transforms.beam_release import PublishedTables

    return {"dprelease": dprelease, "Release": dprelease.Release, "ReleaseResult": dprelease.ReleaseResult,
            "commands": commands, "Ledger": commands.Ledger, "PublishedTables": PublishedTables}


def _run(cell: dict) -> dict:
    """The cell's outcome: exit code (CLI) or the exception raised (API), and everything printed."""
    if cell["kind"] == "cli":
        from click.testing import CliRunner

        from dprelease.pipelines import cli

        result = CliRunner().invoke(cli.main, cell["args"])
        crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
        return {"rc": result.exit_code, "output": result.output,
                "crash": "".join(traceback.format_exception(result.exception)) if crashed else None}
    from dprelease import DPReleaseError

    try:
        value = eval(cell["code"], _namespace())  # noqa: S307 - the test's own expressions
        ok = getattr(value, "ok", True)
        return {"rc": 0 if ok is not False else 1, "output": repr(value)[:4000], "crash": None}
    except DPReleaseError as error:
        return {"rc": error.exit_code, "output": f"{type(error).__name__}: {error}", "crash": None}
    except BaseException:  # noqa: BLE001 - any other exception leaving the API is a failure of the cell
        return {"rc": None, "output": "", "crash": traceback.format_exc()}


def _console_to_file(path: str) -> str:
    """File descriptors 1 and 2 of a cell that launches a JVM (Spark) sent to `path`: the JVM and its Python
    workers write there, not into the worker's protocol pipe, and what they wrote is checked as the cell's output."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def _console_text(path: str) -> str:
    with open(path, errors="replace") as handle:
        text = handle.read()
    os.unlink(path)
    return "\n" + text


def _cell(cell: dict) -> dict:
    fd, result_path = tempfile.mkstemp(prefix="hostile-cell-")
    os.close(fd)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            if cell.get("jvm"):
                console = _console_to_file(result_path + ".console")
            else:
                resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
            os.chdir(cell.get("cwd") or os.getcwd())
            outcome = _run(cell)
            if cell.get("jvm"):
                atexit._run_exitfuncs()  # as the process's end would: the JVM it launched exits first
                outcome["output"] += _console_text(console)
        except BaseException:  # noqa: BLE001
            outcome = {"rc": None, "output": "", "crash": traceback.format_exc()}
        with open(result_path, "w") as handle:
            json.dump(outcome, handle)
        os._exit(0)
    deadline = started + cell["timeout"]
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            os.unlink(result_path)
            return {"rc": None, "output": "", "crash": None, "hung": True, "seconds": cell["timeout"],
                    "maxrss_mb": usage.ru_maxrss / 1024}
        time.sleep(0.01)
    with open(result_path) as handle:
        text = handle.read()
    os.unlink(result_path)
    outcome = json.loads(text) if text else {"rc": None, "output": "", "crash": f"child died (status {status})"}
    outcome.update(hung=False, seconds=time.monotonic() - started, maxrss_mb=usage.ru_maxrss / 1024)
    return outcome


def main() -> None:
    _imports()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_cell(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()

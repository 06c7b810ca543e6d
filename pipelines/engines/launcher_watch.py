"""The watch a launcher keeps on the worker processes it starts that are not forks of it (Beam's DirectRunner
starts its SDK workers with `sh -c python -m ...`; a worker still connecting when its launcher is killed waits
for it forever, one at work holds records): the launcher gives every pipeline of a run a random token among its
pipeline options (`run_mark`), which the runner hands each SDK worker in its environment (PIPELINE_OPTIONS) and
nothing else, and `kill_marked` kills the processes that carry it.

Run as a script by the launcher (`python -I launcher_watch.py TOKEN PID`, standard library only, so it starts in
milliseconds and holds nothing of the launcher's memory): it polls its parent, and when the launcher is gone
(however it exits, SIGKILL included: the watch is re-parented) it kills the marked processes and exits. The
launcher stops it (SIGKILL) when the pipeline is over.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time

MARK_PREFIX = "dprelease_run="
"""How the run's token is written among the pipeline options' experiments: MARK_PREFIX + 32 hex digits."""

TOKEN = re.compile(r"[0-9a-f]{32}")

POLL_SECONDS = 0.2


def run_mark(token: str) -> str:
    """The experiment that marks a run's pipelines and so its SDK workers."""
    return MARK_PREFIX + token


def kill_marked(token: str) -> list[int]:
    """SIGKILL every process (but this one) whose environment, as it was started, holds the run's mark (Linux
    /proc; elsewhere nothing): the SDK workers of the run's pipelines and their shells. Returns their ids."""
    if not TOKEN.fullmatch(token):
        return []
    mark = run_mark(token).encode()
    killed = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if mark in handle.read():
                    os.kill(int(entry), signal.SIGKILL)
                    killed.append(int(entry))
        except OSError:
            continue
    return killed


def main() -> None:
    token, launcher = sys.argv[1], int(sys.argv[2])  # given: the launcher may be gone before this line runs
    while os.getppid() == launcher:
        time.sleep(POLL_SECONDS)
    kill_marked(token)


if __name__ == "__main__":
    main()

"""The watch a launcher keeps on the worker processes it starts that are not forks of it (Beam's DirectRunner
starts its SDK workers with `sh -c python -m ...`; a worker still connecting when its launcher is killed waits
for it forever): every such process carries MARK_VARIABLE=<launcher pid> in its environment, and when the launcher
exits, however it exits (SIGKILL included), the marked processes are killed (`kill_marked`).

Run as a script by the launcher (`python -I launcher_watch.py PID`, standard library only, so it starts in
milliseconds and holds nothing of the launcher's memory): it reads its standard input, a pipe whose other end
only the launcher holds, until end of file, which comes when the launcher closes it or exits.
"""
from __future__ import annotations

import os
import signal
import sys

MARK_VARIABLE = "DPRELEASE_LAUNCHER_PID"
"""Set in the launcher's environment while it starts workers: its process id (inherited by the workers)."""


def kill_marked(launcher: int) -> list[int]:
    """SIGKILL every process (but this one and the launcher) whose environment, as it was started, holds
    MARK_VARIABLE=`launcher` (Linux /proc; elsewhere nothing). Returns their process ids."""
    mark = f"{MARK_VARIABLE}={launcher}".encode()
    killed = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) in (os.getpid(), launcher):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if mark in handle.read().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
                    killed.append(int(entry))
        except OSError:
            continue
    return killed


def main() -> None:
    launcher = int(sys.argv[1])
    while sys.stdin.buffer.read(1 << 16):
        pass
    kill_marked(launcher)


if __name__ == "__main__":
    main()

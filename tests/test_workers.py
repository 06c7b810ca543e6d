"""The embedded engine's worker processes never outlive the run: a failure in the main process terminates them at
once (queued work cancelled), and a main process killed outright takes them with it (they hold confidential
records and the release key)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dprelease.pipelines.engines.workers import worker_pool

from .test_confidential import _alive, _wait_for


def test_a_failure_in_the_main_process_terminates_the_workers_at_once():
    started = time.monotonic()
    with pytest.raises(KeyError):
        with worker_pool(2) as pool:
            futures = [pool.submit(time.sleep, 60) for _ in range(6)]
            assert _wait_for(lambda: len(pool._processes) == 2, timeout=10)
            workers = list(pool._processes)
            raise KeyError("the main process failed")
    assert time.monotonic() - started < 30 and not any(_alive(pid) for pid in workers)
    # the queued work is cancelled; the executor's manager thread settles the stopped work's futures a moment later
    assert _wait_for(lambda: all(f.cancelled() or f.done() for f in futures), timeout=10)


def test_workers_end_with_a_killed_main_process(tmp_path):
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux)")
    script = ("import sys, time\n"
              "from dprelease.pipelines.engines.workers import worker_pool\n"
              "with worker_pool(2) as pool:\n"
              "    futures = [pool.submit(time.sleep, 120) for _ in range(2)]\n"
              "    while len(pool._processes) < 2:\n"
              "        time.sleep(0.01)\n"
              "    print(*pool._processes, flush=True)\n"
              "    time.sleep(120)\n")
    main = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in main.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    main.kill()
    main.wait()
    assert _wait_for(lambda: not any(_alive(pid) for pid in workers), timeout=10), "a worker outlived its killed parent"


def test_nested_termination_blocks_raise_once_and_never_cut_the_clean_up_short():
    """Found by review: the API's `terminate_as_exit` around `run_release`'s own: the inner block raised on the first
    SIGTERM, then put back the outer handler, which raised again on a second SIGTERM in the middle of the outer
    clean-up (a staged copy of the input was left). The blocks share one process-wide state now."""
    import os
    import signal

    from dprelease.pipelines.housekeeping import Terminated, terminate_as_exit

    cleaned = []
    with pytest.raises(Terminated):
        with terminate_as_exit():
            try:
                with terminate_as_exit():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a supervisor escalating: ignored until the outer block ends
                time.sleep(0.2)
                cleaned.append(True)
    assert cleaned == [True]

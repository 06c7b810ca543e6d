"""Worker processes on one machine (the embedded engine's reading, counting and noise; post-processing's groups).

`worker_pool` is a ProcessPoolExecutor whose workers hold confidential records and the release key, so they must
never outlive the run: they ignore Ctrl-C and die on SIGTERM (only the main process handles signals and cleans up),
die with the main process (Linux: PR_SET_PDEATHSIG, so a SIGKILLed run leaves no worker holding the key), and a
failure or signal in the main process cancels the queued work and terminates them before its clean-up runs (the
spill directory is removed only once no worker can still write into it).
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

from ..housekeeping import shielded

PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def worker_pool(workers: int, initializer=None, initargs: tuple = ()):
    """A process pool of `workers` (each running `initializer(*initargs)` first) that is shut down normally when
    the block ends, and whose queued work is cancelled and workers terminated when the block raises (any
    exception, KeyboardInterrupt and SIGTERM's Terminated included)."""
    context = _TrackedContext(multiprocessing.get_context())
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_start_worker,
                               initargs=(os.getpid(), initializer, initargs))
    try:
        yield pool
    except BaseException:
        with shielded():  # a later signal never cuts the termination short (the spill is removed after it)
            _terminate(pool, context.made)
        raise
    pool.shutdown(wait=True)


class _TrackedContext:
    """A multiprocessing context that keeps every process it makes (`made`): a pool's workers, each known from the
    moment it exists, before the pool registers it (a signal between the fork and the registration left one out of
    the termination: the exit then joined it forever). Everything else is the wrapped context's."""

    def __init__(self, context):
        self._context = context
        self.made: list = []

    def Process(self, *args, **kwargs):  # noqa: N802 - the name ProcessPoolExecutor calls
        process = self._context.Process(*args, **kwargs)
        self.made.append(process)
        return process

    def __getattr__(self, name):
        return getattr(self._context, name)


def _start_worker(parent: int, initializer, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with(parent)
    if initializer is not None:
        initializer(*initargs)


def _die_with(parent: int) -> None:
    """SIGTERM this worker when its parent exits (Linux); exit at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


TERMINATE_SECONDS = 2.0
"""How long a worker gets to die of SIGTERM before it is killed (SIGKILL)."""


def _terminate(pool: ProcessPoolExecutor, workers: list) -> None:
    """Cancel what is queued and stop every worker now (running work is not waited for): SIGTERM, then SIGKILL for
    a worker still alive after TERMINATE_SECONDS. A worker forked a moment before still runs the parent's SIGTERM
    handler until `_start_worker` resets it, and that handler can lose its exception in an at-fork callback (found
    under load: the worker lived on, and the run hung joining it). `workers`: every process the pool made, those it
    has not registered yet included (`_TrackedContext`); no other process of the host is touched."""
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        with contextlib.suppress(Exception):  # one not started yet has nothing to stop
            process.terminate()
    for process in workers:
        with contextlib.suppress(Exception):
            process.join(TERMINATE_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()

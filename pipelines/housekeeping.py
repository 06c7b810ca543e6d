"""Which process owns a run's leftovers, removing those of runs that died, and the private files a run
leaves for its operator (validation reports, failure details).

A run names its staging and spill directories after its process: host, boot and PID namespace, pid and the
process's start time, so a reused pid is never taken for the dead run, nor a live process of another
machine or container that shares the host name and the directory (but not the PID namespace) for a dead one;
a process whose /proc entry cannot be read is never told dead. A later run of the same release removes the
leftovers of its dead predecessors (SIGKILL cannot be caught);
everything else a run creates is removed on its own exit paths, SIGTERM included.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def _start_ticks(pid: int) -> str | None:
    """The start time of a process (clock ticks since boot, from /proc), or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_token(pid: int | None = None) -> str:
    """`pid.start` of this (or another) process: unique on this host across pid reuse."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start_ticks(pid) or 0}"


@functools.cache
def _pid_namespace() -> str:
    """The inode of this process's PID namespace ('0' where it cannot be read): two containers that share a host
    name and a directory but not their PIDs have different ones. Read once: a process never changes its own
    PID namespace (`setns` moves only its children)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


@functools.cache
def _boot_id() -> str:
    """This machine's boot (the kernel's random boot id, 16 hex digits; '0' where it cannot be read): the PID
    namespace's inode alone is the same number on every host (the initial namespace's is fixed). Read once: it
    changes only with a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16] or "0"
    except OSError:
        return "0"


# a child forked after `unshare(CLONE_NEWPID)` is in another namespace than the parent whose reads it inherits
# (found by review: its leftovers were tagged with the parent's namespace and swept by the parent while alive)
os.register_at_fork(after_in_child=lambda: (_pid_namespace.cache_clear(), _boot_id.cache_clear()))


def _plain_name(text: str) -> str:
    """`text` with every character but letters, digits, '.' and '-' written `_xx` (hex): a host name can never carry
    a tag's separators ('@', '+', '~'), and two names stay two names."""
    return "".join(c if c.isascii() and (c.isalnum() or c in ".-") else f"_{ord(c):02x}" for c in text)


def host_identity() -> str:
    """`host~boot~pidns`: the PID space a `pid.start` token names a process in (the host name, this boot of its
    machine, its PID namespace). A process of another identity is never told alive or dead here: a pid in another
    namespace or on another machine may be live while this /proc has no such pid. Directories of a boot before
    the last reboot are left for that reason."""
    return f"{_plain_name(socket.gethostname())}~{_boot_id()}~{_pid_namespace()}"


def leftover_tag() -> str:
    """`pid.start@host~boot~pidns@`: what names a run's staging, replaced and spill directories after their prefix."""
    return f"{process_token()}@{host_identity()}@"


def store_leftover_tag() -> str:
    """`pid.start+host~boot~pidns+`: `leftover_tag` for a staging prefix in an object store ('@' in a URI is user
    info)."""
    return f"{process_token()}+{host_identity()}+"


def input_copy_prefix(release_id: str) -> str:
    """Name prefix of a Python API run's private copy of in-memory data in TMPDIR (`leftover_tag` follows it, so
    the next run of the release removes a copy that a killed run left)."""
    return f"dprelease-input-{release_id}@"


RUN_TEMPORARY_PREFIXES = ("dprelease-publish@", "dprelease-beam@")
"""Name prefixes of a run's private directories in TMPDIR that are not a release's own (the local copy of a
release published to a store; the Beam engine's results: noisy ranges, the key file): `leftover_tag` follows."""


def run_temporary_directory(prefix: str) -> Path:
    """A new private (0700) directory in TMPDIR named `<prefix><pid.start>@<host~boot~pidns>@<random>`, `prefix` one of
    RUN_TEMPORARY_PREFIXES: the next run on this host removes it if its process died (`remove_stale`)."""
    import tempfile

    assert prefix in RUN_TEMPORARY_PREFIXES, prefix
    return Path(tempfile.mkdtemp(prefix=prefix + leftover_tag()))


def owner() -> str:
    """The owner of a ledger reservation, for people (host:pid.start). Only rows an older dprelease reserved without
    a lease are settled by it (`owner_alive`); a run's rows now live by their lease."""
    return f"{socket.gethostname()}:{process_token()}"


TOKEN = re.compile(r"^[0-9]+\.[0-9]+$")


def process_alive(identity: str, token: str) -> bool | None:
    """Whether the process `pid.start` of `identity` (`host_identity()`) still runs: True/False in this host's PID
    namespace, None for another host or namespace, or where /proc cannot be read (cannot be told here). A
    malformed token names no process: False."""
    if identity != host_identity() or "0" in (_pid_namespace(), _boot_id()):
        return None
    return _alive_here(token)


def _alive_here(token: str) -> bool | None:
    """Whether `pid.start` runs in this process's PID namespace: False only when no process has that pid, or the
    one that has it started at another time; None where it cannot be told (no /proc, or the pid's entry hidden from
    this user: `hidepid`, found by review, would have told another user's live run dead)."""
    if _start_ticks(os.getpid()) is None:  # no /proc (another system, or hidden): no process can be told dead
        return None
    if not TOKEN.fullmatch(token):
        return False
    pid_text, _, start = token.partition(".")
    pid = int(pid_text)
    found = _start_ticks(pid)
    if found is not None:
        return found == start
    if pid <= 0:  # names no single process (kill would signal a group)
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # exists, another user's
        return None
    return None  # exists, its start time unreadable


def owner_alive(owner_text: str) -> bool | None:
    """Whether a ledger reservation's owner (`owner()`: host:pid.start, no namespace: written by an older dprelease)
    still runs: None for another host. Such rows predate containers sharing a host name as far as this knows."""
    host, _, token = owner_text.rpartition(":")
    return _alive_here(token) if host == socket.gethostname() else None


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories `<parent>/<prefix><pid.start>@<host~boot~pidns>@...` (prefix ends in '@', see
    `leftover_tag`) whose process in this host's PID namespace is gone; never follows a link, and never touches a
    name without the prefix and a well-formed token, nor one of another host or namespace (a shared directory).
    Returns what was removed."""
    removed = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix) or entry.is_symlink() or not entry.is_dir():
            continue
        token, _, rest = entry.name[len(prefix):].partition("@")
        if TOKEN.fullmatch(token) and process_alive(rest.partition("@")[0], token) is False:
            shutil.rmtree(entry, ignore_errors=True)
            if not os.path.lexists(entry):  # said removed only when it is gone
                removed.append(entry)
    return removed


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM (or SIGHUP) so that every `finally` (spill, staging, reservation) runs."""


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals a `terminate_as_exit` block turns into `Terminated` (exit 128 + the signal): a supervisor's stop and a
dropped terminal or ssh session both clean up as a failure does. SIGHUP only where it would kill the process
(its default action): one ignored (`nohup`) or handled by a host program is left as it was."""

REPEAT_SECONDS = 5.0
"""A later signal within this long of the one raised is ignored (the clean-up it started runs to its end); one
after it raises again: a clean-up that blocks (a runner joining workers that never exit), or a `Terminated` a
callback dropped, never leaves the process stoppable only by SIGKILL."""

_TERMINATION = {"active": False, "raised": None, "signal": None, "shielded": 0, "deferred": None}
"""Process-wide: whether a `terminate_as_exit` block is active, when (monotonic seconds) and by which signal its
last `Terminated` was raised (None: not yet), how many `shielded` sections are open and the signal one deferred."""

_ON_TERMINATE: list = []
"""Callables the handler runs before it raises (`on_terminate`): quick, never raising (each is guarded)."""


@contextmanager
def on_terminate(action):
    """Run `action()` first when a terminating signal arrives during the block: stopping what the clean-up would
    otherwise wait for forever (Beam's runner joins its SDK worker processes in a `finally` of its own)."""
    _ON_TERMINATE.append(action)
    try:
        yield
    finally:
        _ON_TERMINATE.remove(action)


@contextmanager
def terminate_as_exit():
    """While active, the first SIGTERM or SIGHUP raises `Terminated` (exit 128 + the signal) instead of killing the
    process outright, after the `on_terminate` actions; a later one within REPEAT_SECONDS is ignored, so the clean-up
    it starts is not cut short, and one after that raises again. Nested blocks (the API's around `run_release`'s)
    share the outermost one's handler. A block entered outside the main thread installs nothing (Python delivers
    signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread() or _TERMINATION["active"]:
        yield
        return

    def handler(signum, frame):
        if _TERMINATION["shielded"]:
            _TERMINATION["deferred"] = signum  # raised as the section ends
            return
        raised = _TERMINATION["raised"]
        if raised is not None and time.monotonic() - raised < REPEAT_SECONDS:
            return  # a repeated signal during the clean-up: the clean-up runs to its end
        _TERMINATION.update(raised=time.monotonic(), signal=signum)
        for action in list(_ON_TERMINATE):
            with contextlib.suppress(Exception):
                action()
        raise Terminated(128 + signum)

    previous = {number: signal.signal(number, handler) for number in TERMINATING_SIGNALS
                if number == signal.SIGTERM or signal.getsignal(number) == signal.SIG_DFL}
    _TERMINATION.update(active=True, raised=None, signal=None)
    try:
        yield
        raise_if_terminated()  # a SIGTERM whose exception was dropped ends the block as one that arrived would
    finally:
        for number, handling in previous.items():  # None: set outside Python, which Python cannot put back
            signal.signal(number, handling if handling is not None else signal.SIG_DFL)
        _TERMINATION.update(active=False, raised=None, signal=None, deferred=None)


@contextmanager
def shielded():
    """A clean-up step a terminating signal must not cut short (terminating workers before their spill directory is
    removed, aborting a reservation): a signal arriving during it is deferred to the end of the outermost section,
    then raised (`Terminated`), or, where an exception is already being handled (the section is part of its
    clean-up), recorded as raised (`raise_if_terminated` and the block's end see it)."""
    _TERMINATION["shielded"] += 1
    try:
        yield
    finally:
        _TERMINATION["shielded"] -= 1
        deferred = _TERMINATION["deferred"]
        if not _TERMINATION["shielded"] and deferred is not None:
            _TERMINATION["deferred"] = None
            if _TERMINATION["active"]:
                _TERMINATION.update(raised=time.monotonic(), signal=deferred)
                if sys.exc_info()[0] is None:
                    raise Terminated(128 + deferred)


@contextmanager
def shielded_temporary_directory(prefix: str):
    """A private (0700) temporary directory, its path yielded, removed as the block ends on every path: made and
    removed under `shielded`, so a terminating signal arriving as it is made (between the mkdir and the clean-up's
    registration) or as it is removed (after its finalizer is detached) is deferred instead of leaving it."""
    import tempfile

    directory = None
    try:
        with shielded():
            directory = tempfile.TemporaryDirectory(prefix=prefix)
        yield directory.name
    finally:
        if directory is not None:
            with shielded():
                directory.cleanup()


def raise_if_terminated() -> None:
    """Raise `Terminated` if this process's SIGTERM (or SIGHUP) was handled but its exception never arrived. A handler
    runs between any two bytecodes of the main thread, callbacks whose exceptions Python prints and drops included
    (logging's at-fork hook as a worker pool forks, a finalizer): the run would go on and publish. Called on the
    normal path before each irreversible step (the reservation, a charge before publication, staging in a store,
    the ledger commit, the rename into place), and as a `terminate_as_exit` block ends, so every command under one
    exits as terminated. Only the main thread raises (the one the handler raised in)."""
    if _TERMINATION["active"] and _TERMINATION["raised"] is not None \
            and threading.current_thread() is threading.main_thread():
        raise Terminated(128 + _TERMINATION["signal"])


def write_failure(internal_dir: Path, stage: str) -> Path | None:
    """The exception being handled, its traceback in a private file of the internal directory
    (failure-<stage>-<pid>.txt); None when it cannot be written (the directory not private, among others)."""
    import traceback

    from dprelease.accounting.errors import DPReleaseError

    from .storage import private_directory, write_private

    trace = traceback.format_exc()
    try:
        directory = private_directory(internal_dir, "--internal-dir")
        return write_private(directory / f"failure-{stage.replace(' ', '-')}-{os.getpid()}.txt", trace)
    except (OSError, DPReleaseError):
        return None

"""Local files, read and written through one set of guards: only regular files inside a root, links never
followed below it, reads bounded, private directories and files owner-only (and never made so by a chmod of
something that already existed).

Reading files of a release directory that anyone may have written: only regular files inside it.

A published release is untrusted input for `verify`, `report`, `synthesize` and `ledger reconcile`: a
manifest may name any path, a file may be a symbolic link (to the password database), a FIFO (a read
that never returns) or a device (/dev/zero: endless bytes). Every path here is opened component by
component relative to the release directory with O_NOFOLLOW (a link anywhere below the release
directory is refused, so a later swap cannot redirect the read), the last one with O_NONBLOCK (opening
a FIFO returns at once) and then checked to be a regular file; reads are bounded.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import shown


class UnsafeFile(Exception):
    """A path that is not a regular file inside the directory, or one too large to read."""


def safe_relative(path: object) -> str | None:
    """The path if it is a plain relative POSIX path inside a directory (no '..', '.', '/' prefix,
    backslash or NUL), else None."""
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        return None
    parts = PurePosixPath(path).parts
    if path.startswith("/") or any(p in ("..", ".", "") for p in parts) or PurePosixPath(*parts).as_posix() != path:
        return None
    return path


def open_inside(root: Path, relative: str) -> int:
    """A read-only file descriptor of the regular file `relative` below `root`, no link followed below root."""
    checked = safe_relative(relative)
    if checked is None:
        raise UnsafeFile(f"{relative!r} is not a plain relative path")
    parts = checked.split("/")
    try:
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise UnsafeFile(f"{root}: cannot be opened as a directory ({error.strerror})") from None
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            except OSError as error:
                raise UnsafeFile(f"{relative}: {part} is not a directory inside the release "
                                 f"({error.strerror})") from None
            os.close(directory)
            directory = inner
        return _open_regular(parts[-1], directory, relative)
    finally:
        os.close(directory)


def _regular_descriptor(path: str | Path, flags: int = 0, directory: int | None = None) -> int | None:
    """A blocking read-only descriptor of `path` if it is a regular file, else None (closed again). Opened with
    O_NONBLOCK, so a FIFO returns at once instead of waiting for a writer; OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | flags, dir_fd=directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


def _open_regular(name: str, directory: int | None, label: str) -> int:
    try:
        fd = _regular_descriptor(name, os.O_NOFOLLOW, directory)
    except OSError as error:
        raise UnsafeFile(f"{label}: cannot be opened as a regular file ({error.strerror})") from None
    if fd is None:
        raise UnsafeFile(f"{label}: not a regular file")
    return fd


def open_file(root: Path, relative: str) -> BinaryIO:
    """`open_inside` as a binary file object (for pyarrow readers)."""
    return os.fdopen(open_inside(root, relative), "rb")


def read_inside(root: Path, relative: str, limit: int) -> bytes:
    """The bytes of a regular file below `root`, refusing one larger than `limit` bytes."""
    with open_file(root, relative) as handle:
        return _bounded(handle, limit, relative)


def buffer_inside(root: Path, relative: str, limit: int):
    """A regular file below `root` read into a pyarrow buffer (at most `limit` bytes): readers then run on
    native memory, never calling back into a Python file object from their threads."""
    import pyarrow as pa

    return pa.BufferReader(pa.py_buffer(read_inside(root, relative, limit)))


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path` when it is a regular file (its last component not a link) of at most `limit`
    bytes; the directories above it are taken as they are (a release directory named in the ledger)."""
    path = Path(path)
    try:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise UnsafeFile(f"{path.parent}: cannot be opened as a directory ({error.strerror})") from None
    try:
        fd = _open_regular(path.name, directory, str(path))
    finally:
        os.close(directory)
    with os.fdopen(fd, "rb") as handle:
        return _bounded(handle, limit, str(path))


def _bounded(handle: BinaryIO, limit: int, label: str) -> bytes:
    data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(f"{label}: larger than {limit:,} bytes")
    return data


def regular_directory(path: Path) -> bool:
    """Whether `path` is a directory that is not a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def tree_entries(root: Path) -> list[tuple[str, str]]:
    """(relative POSIX path, kind) of everything below `root`, never following a link: kind is 'file',
    'dir', 'link' or 'other' (FIFO, device, socket)."""
    found: list[tuple[str, str]] = []
    pending = [""]
    while pending:
        prefix = pending.pop()
        try:
            with os.scandir(root / prefix if prefix else root) as entries:
                for entry in entries:
                    relative = f"{prefix}/{entry.name}" if prefix else entry.name
                    if entry.is_symlink():
                        found.append((relative, "link"))
                    elif entry.is_dir(follow_symlinks=False):
                        found.append((relative, "dir"))
                        pending.append(relative)
                    elif entry.is_file(follow_symlinks=False):
                        found.append((relative, "file"))
                    else:
                        found.append((relative, "other"))
        except OSError:
            found.append((prefix or ".", "other"))
    return sorted(found)


def inside(root: Path, relative: str) -> Path:
    """root / relative, refusing (ValueError) a relative path that is not plain or leaves root: where a
    writer joins a name taken from a spec."""
    if safe_relative(relative) is None:
        raise ValueError(f"{relative!r}: not a plain relative path")
    joined = Path(root) / relative
    if not joined.resolve().is_relative_to(Path(root).resolve()):
        raise ValueError(f"{relative!r}: leaves {root}")
    return joined


def read_named(path: Path | str, limit: int, field: str) -> bytes:
    """The bytes of a file a user named (a spec, a key, a public or private signing key): opened without
    blocking (a FIFO returns at once) and read only when it is a regular file of at most `limit` bytes, so a
    FIFO, a device (/dev/zero) or a huge file is a SpecError (exit 2) naming `field`, never a hang or a read
    that exhausts memory. A link the user named is followed (they named it), to a regular file only."""
    if not isinstance(path, (str, Path)) or not str(path) or "\0" in str(path):
        raise SpecError(f"{field} = {shown(path)!r}: a path to a file")
    try:
        fd = _regular_descriptor(path)
    except OSError as error:
        raise SpecError(f"{field} = {shown(path)!r}: cannot be read ({error.strerror})") from None
    if fd is None:
        raise SpecError(f"{field} = {shown(path)!r}: not a regular file (a FIFO, a device or a directory)")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise SpecError(f"{field} = {shown(path)!r}: too large; at most {limit:,} bytes")
    return data


def read_regular_start(path: Path | str, limit: int) -> bytes | None:
    """At most `limit` bytes from the start of a configuration file the environment points at (links followed),
    or None when it cannot be opened or is not a regular file: opened without blocking, so a FIFO or a device in
    its place is skipped at once, never waited on or read without end."""
    try:
        fd = _regular_descriptor(path)
    except OSError:
        return None
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        try:
            return handle.read(limit)
        except OSError:
            return None


def private_directory(path: Path | str, field: str) -> Path:
    """A directory for confidential files (validation reports, reconstruction results, failure details): a new
    one is created owner-only (0700); an existing one must be a real directory (not a link), owned by this user
    and already private. It is never made private by changing the mode of something that exists (which could
    be someone else's directory reached through a link). Never inside a release. SpecError (exit 2) otherwise."""
    from .targets import check_outside_releases

    path = Path(path)
    check_outside_releases(path.parent.resolve() / path.name / "report", field, path,  # the directory, or above it
                           "confidential files never go into a release")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return private_directory(path, field)
        except OSError as error:
            raise SpecError(f"{field} = {shown(path)!r}: cannot be created ({error.strerror})") from None
        os.chmod(path, 0o700)  # the directory just made (umask may have narrowed it, never widened)
        return path
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise SpecError(f"{field} = {shown(path)!r}: exists and is not a directory (or is a symbolic link); name "
                        "a private directory of yours or a new one")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SpecError(f"{field} = {shown(path)!r}: exists with mode {stat.S_IMODE(info.st_mode):04o} (owner uid "
                        f"{info.st_uid}); a directory for confidential files must be yours and private: name a new "
                        f"one, or chmod 700 it yourself")
    return path


def write_private(path: Path, data: bytes | str, overwrite: bool = True) -> Path:
    """Write a file readable by its owner only (0600, also when it existed before with a wider mode), never
    through a link: what it holds is confidential (counts, sample values, tracebacks that may quote values).
    Without `overwrite` an existing file is refused (FileExistsError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)

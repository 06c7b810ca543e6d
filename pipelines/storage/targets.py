"""Where outputs go: files that `report`, `synthesize` and `demo-data` write, and the directories releases are
published into. Never inside a published release (except by the release writer), never over a link, never over
an existing file unless asked (`overwrite`), always whole (written beside, then renamed into place)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import shown

MANIFEST = "manifest.json"


def release_holding(path: Path) -> Path | None:
    """The release directory (a directory with a manifest.json) that `path` lies in, if any (links resolved)."""
    path = Path(path).absolute()
    for directory in [path.parent, *path.parent.parents]:
        if (directory / MANIFEST).is_file():
            return directory
    return None


def check_outside_releases(probe: Path, field: str, given: object, why: str) -> None:
    """SpecError (exit 2) when `probe` lies in a published release (`release_holding`), naming `field`, the
    location as the user `given` it, the release and `why` nothing of its kind goes there. To cover a directory
    itself as well as those above it, probe a name inside it."""
    holder = release_holding(probe)
    if holder is not None:
        raise SpecError(f"{field} = {shown(given)!r}: inside the release {shown(holder)}; {why}")


def check_release_target(final_dir: Path, overwrite: bool) -> None:
    """Where a release directory will be published: never a symbolic link (replacing one would delete or write
    outside it), never inside another published release (writing there changes what was published), an existing
    directory only with `overwrite`. SpecError (exit 2) naming the directory otherwise."""
    final_dir = Path(final_dir)
    if final_dir.is_symlink():
        raise SpecError(f"output: release directory {shown(final_dir)} is a symbolic link; publish to a real "
                        "directory")
    check_outside_releases(final_dir.parent.resolve() / final_dir.name, "output", final_dir,
                           "publish beside it, never into it")
    if final_dir.exists() and not overwrite:
        raise SpecError(f"output: release directory {shown(final_dir)} already exists; pass --overwrite to replace it")
    if final_dir.exists() and not final_dir.is_dir():
        raise SpecError(f"output: {shown(final_dir)} exists and is not a directory")


def check_output_file(path: Path, overwrite: bool, option: str) -> Path:
    """The file to write, resolved; SpecError (exit 2) when it lies inside a release (writing there would
    change what was published and make it fail verify), is a link or a directory, or exists without
    `overwrite`."""
    path = Path(path)
    if path.is_symlink():
        raise SpecError(f"{option} = {shown(path)!r}: a symbolic link; name a regular file")
    target = path.parent.resolve() / path.name
    check_outside_releases(target, option, path, "write beside it, never into it")
    if target.is_dir():
        raise SpecError(f"{option} = {shown(path)!r}: a directory; name a file")
    if target.exists() and not overwrite:
        raise SpecError(f"{option} = {shown(path)!r}: exists; pass --overwrite to replace it")
    if target.exists() and not target.is_file():
        raise SpecError(f"{option} = {shown(path)!r}: exists and is not a regular file (a FIFO or a device)")
    return target


def write_atomically(target: Path, overwrite: bool, write: Callable[[BinaryIO], None]) -> Path:
    """Write a new file beside `target` with `write(handle)` and rename it into place: a reader never sees
    half a file and a link planted at `target` meanwhile is replaced, never followed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.partial"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        if not overwrite and target.exists():
            raise SpecError(f"{shown(target)}: appeared while writing; pass --overwrite to replace it")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target

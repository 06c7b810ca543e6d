"""Where a release key lives and when an existing key file may be used.

Privacy: the key is the only secret behind the noise. A key file readable by anyone else, owned by
someone else, or lying inside the output tree (where a release is published, copied or replaced) is
refused before anything is reserved or drawn.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import shown
from dprelease.transforms.csprng import ReleaseKey

from .manifest import file_stamp
from .storage import read_named


def default_key_path(spec_dir: Path, release_id: str, created_at: str) -> Path:
    """<spec dir>/keys/<release id>-<time>-<random>.key: a fresh name for a fresh key."""
    return spec_dir / "keys" / f"{release_id}-{file_stamp(created_at)}-{os.urandom(3).hex()}.key"


def check_key_location(key_path: Path, output_root: Path) -> None:
    """Refuse a key file inside the output tree (publishing, copying or --overwrite of a release there
    must never carry or delete a key), or inside any published release (which is copied to the public)."""
    from .storage import check_outside_releases

    resolved = key_path.expanduser().resolve()
    check_outside_releases(resolved, "--key-file", key_path, "keep keys outside every release")
    if resolved.is_relative_to(output_root.expanduser().resolve()):
        raise SpecError(f"--key-file = {shown(key_path)!r}: lies inside the output directory {output_root}; keep keys "
                        "outside every release tree (pass --key-file elsewhere, or set output.dir to a directory "
                        "that does not hold <spec dir>/keys)")


def _check_private(path: Path) -> None:
    """An existing key file must be a regular file owned by this user and readable by nobody else."""
    try:
        info = path.stat()
    except OSError as error:
        raise SpecError(f"--key-file = {shown(path)!r}: cannot be read ({error.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(f"--key-file = {shown(path)!r}: not a regular file")
    if info.st_uid != os.getuid():
        raise SpecError(f"--key-file = {shown(path)!r}: owned by uid {info.st_uid}, not by this user ({os.getuid()}); "
                        "a key must be private to the user who runs the release")
    if info.st_mode & 0o077:
        raise SpecError(f"--key-file = {shown(path)!r}: mode {stat.S_IMODE(info.st_mode):04o} lets group or others "
                        f"read or write it; allowed: 0600 or 0400 (chmod 600 {path})")


MAX_KEY_FILE_BYTES = 4096


def load_or_generate(key_path: Path) -> tuple[ReleaseKey, bool]:
    """(key, reused): the key in `key_path` if it exists (after the privacy checks; read without blocking and
    bounded, so a FIFO or a device is refused), else a fresh key from the OS (saved by the caller once the run
    may go ahead)."""
    if key_path.exists() or key_path.is_symlink():
        _check_private(key_path)
        data = read_named(key_path, MAX_KEY_FILE_BYTES, "--key-file")
        try:
            return ReleaseKey.from_hex(data), True
        except ValueError as error:
            raise SpecError(f"--key-file = {shown(key_path)!r}: {error}") from None
    return ReleaseKey.generate(), False

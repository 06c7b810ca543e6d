"""Releases in an object store (s3://, gs://, hdfs:// through pyarrow's filesystems, as inputs are: `storage`).

An object store has no atomic rename, so a release is published there as it is written nowhere else: staged
and committed on the driver's local disk as usual, then uploaded file by file with `manifest.json` last. A
release exists in the store once its manifest does: readers (verify, report, `ReleaseResult.open`, `ledger
reconcile`) start from the manifest. Objects under a release's prefix without one (an upload that failed, or
anything else) are never removed without `--overwrite`: a rerun with the same key and `--overwrite` replaces
them and republishes at no further cost.

Reading one back (verify, report) downloads it into a private temporary directory, each object read at most
to the size its manifest states (plus one byte, so a longer object is a mismatch, not a long read); then the
local checks run on the copy unchanged.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from dprelease.accounting.errors import DPReleaseError, SpecError

from .outputs import MANIFEST
from .safe_files import safe_relative
from .storage import Store, is_uri, open_store
from .verify import MAX_MANIFEST_BYTES

UNLISTED_READ = 1 << 20
"""Bytes read of an object the manifest does not list (enough for verify to name it as unlisted)."""
COPY_BLOCK = 8 << 20


@dataclass(frozen=True)
class RemoteRelease:
    """A release directory in a store: `path` is the store's path of the release's prefix."""

    store: Store
    path: str
    query: str = ""

    @property
    def uri(self) -> str:
        """The release's URI, with the connection settings it was named with (public: see storage)."""
        return self.store.uri(self.path) + (f"?{self.query}" if self.query else "")

    def object_path(self, relative: str) -> str:
        return f"{self.path}/{relative}"

    def exists(self) -> bool:
        """Published: its manifest is there."""
        info = self.store.filesystem.get_file_info(self.object_path(MANIFEST))
        return info.type == pafs.FileType.File

    def objects(self) -> dict[str, int]:
        """Every object under the release's prefix: relative path -> size."""
        selector = pafs.FileSelector(self.path, recursive=True, allow_not_found=True)
        infos = self.store.filesystem.get_file_info(selector)
        return {info.path[len(self.path) + 1:]: info.size for info in infos if info.type == pafs.FileType.File}


def open_release(uri: str, field: str) -> RemoteRelease:
    """The release at `uri` (SpecError, exit 2, for a URI the storage rules refuse)."""
    store, path = open_store(uri, field)
    return RemoteRelease(store, path.rstrip("/"), uri.split("?", 1)[1] if "?" in uri else "")


def release_under(root_uri: str, release_id: str, field: str) -> RemoteRelease:
    """The release `release_id` under the output URI `root_uri`."""
    root = open_release(root_uri, field)
    return RemoteRelease(root.store, f"{root.path}/{release_id}", root.query)


def check_remote_target(release: RemoteRelease, overwrite: bool) -> None:
    """Refuse to publish where the store holds anything under the release's prefix (a release, the leftovers of
    a failed upload, or other objects) without `overwrite`, as a local run refuses an existing directory."""
    try:
        held = release.objects()
    except (pa.ArrowException, OSError) as error:
        raise SpecError(f"output: {release.uri}: cannot be reached ({type(error).__name__})") from None
    if held and not overwrite:
        what = "a release" if MANIFEST in held else f"{len(held)} object(s) but no manifest (a failed upload?)"
        raise SpecError(f"output: {release.uri.split('?', 1)[0]} already holds {what}; pass --overwrite to "
                        "replace it")


def upload_release(local_dir: Path, release: RemoteRelease, overwrite: bool) -> None:
    """Publish the staged release at `local_dir` to the store: with `overwrite`, what the prefix holds is removed
    first (a manifest first, so it stops being a release); then every file is copied, the manifest last: a
    reader never sees a manifest whose files are not all there."""
    check_remote_target(release, overwrite)
    filesystem = release.store.filesystem
    old = release.objects()
    if MANIFEST in old:
        filesystem.delete_file(release.object_path(MANIFEST))
    for relative in sorted(set(old) - {MANIFEST}):
        filesystem.delete_file(release.object_path(relative))
    files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    for relative in [f for f in files if f != MANIFEST] + [MANIFEST]:
        _upload_file(local_dir / relative, filesystem, release.object_path(relative))


def _upload_file(local: Path, filesystem: pafs.FileSystem, path: str) -> None:
    with open(local, "rb") as source, filesystem.open_output_stream(path) as target:
        shutil.copyfileobj(source, target, COPY_BLOCK)


def _read_bounded(release: RemoteRelease, relative: str, limit: int) -> bytes:
    with release.store.filesystem.open_input_stream(release.object_path(relative)) as handle:
        return handle.read(limit)


def _copy_bounded(release: RemoteRelease, relative: str, limit: int, target: Path) -> None:
    """At most `limit` bytes of an object into `target`, a block at a time."""
    with release.store.filesystem.open_input_stream(release.object_path(relative)) as handle, \
            open(target, "wb") as out:
        while limit > 0:
            block = handle.read(min(COPY_BLOCK, limit))
            if not block:
                break
            out.write(block)
            limit -= len(block)


MAX_LISTED_BYTES = 1 << 50
"""A manifest's claimed file size above this is not a size (verify reports the file as mismatched)."""
MAX_UNLISTED_OBJECTS = 100
"""Unlisted objects read (UNLISTED_READ bytes each) before the rest are named only (empty local files)."""


def _listed_sizes(manifest_bytes: bytes) -> dict[str, int]:
    """The files the manifest lists and their sizes ({} for a manifest that does not parse: verify says why)."""
    try:
        manifest = json.loads(manifest_bytes)
        files = manifest["files"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return {}
    sizes = {}
    for entry in files if isinstance(files, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("bytes"), int) \
                and 0 <= entry["bytes"] <= MAX_LISTED_BYTES:
            sizes[entry["path"]] = entry["bytes"]
    return sizes


@contextlib.contextmanager
def downloaded(uri: str, field: str = "RELEASE") -> Iterator[Path]:
    """A local, private copy of the release at `uri`, removed afterwards. Each object is read at most to the
    smaller of its size and its listed size plus one byte (so a longer object is a mismatch, not a long read);
    unlisted objects to UNLISTED_READ bytes, the first MAX_UNLISTED_OBJECTS of them (the rest named by empty
    files); names that would leave the copy, or that a store cannot open, are skipped (verify reports listed
    ones missing); an object that cannot be read is left out the same way."""
    release = open_release(uri, field)
    shown = uri.split("?", 1)[0]
    try:
        objects = release.objects()
    except (pa.ArrowException, OSError) as error:
        raise DPReleaseError(f"{field} = {shown!r}: cannot be listed ({type(error).__name__})") from None
    if MANIFEST not in objects:
        raise DPReleaseError(f"{field} = {shown!r}: no {MANIFEST} there: not a published release")
    holder = Path(tempfile.mkdtemp(prefix="dprelease-download-"))
    try:
        copy = holder / PurePosixPath(release.path).name
        copy.mkdir(mode=0o700)
        try:
            manifest_bytes = _read_bounded(release, MANIFEST, MAX_MANIFEST_BYTES + 1)
        except (pa.ArrowException, OSError) as error:
            raise DPReleaseError(f"{field} = {shown!r}: {MANIFEST} cannot be read ({type(error).__name__})") \
                from None
        (copy / MANIFEST).write_bytes(manifest_bytes)
        listed = _listed_sizes(manifest_bytes)
        unlisted = 0
        for relative, size in sorted(objects.items()):
            if relative == MANIFEST or safe_relative(relative) is None:  # would leave the copy, or unopenable
                continue
            target = copy / relative
            if relative in listed:
                limit = min(size, listed[relative] + 1)
            else:
                unlisted += 1
                limit = UNLISTED_READ if unlisted <= MAX_UNLISTED_OBJECTS else 0
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                _copy_bounded(release, relative, limit, target)
            except (pa.ArrowException, OSError):  # unreadable, or an object that is also a prefix
                with contextlib.suppress(OSError):
                    target.unlink(missing_ok=True)
        yield copy
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def read_manifest_bytes(uri: str) -> bytes | None:
    """The manifest object of the release at `uri` (bounded), or None when there is none (for reconcile)."""
    try:
        release = open_release(uri, "release_dir")
        if not release.exists():
            return None
        data = _read_bounded(release, MANIFEST, MAX_MANIFEST_BYTES + 1)
    except (DPReleaseError, pa.ArrowException, OSError):
        return None
    return data if len(data) <= MAX_MANIFEST_BYTES else None


__all__ = ["RemoteRelease", "check_remote_target", "downloaded", "is_uri", "open_release", "read_manifest_bytes",
           "release_under", "upload_release"]
